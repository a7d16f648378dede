"""Time to accuracy: which reduction reaches a target loss first, per link rate?

Step time alone rewards a method that sends few bytes even when it needs
many more steps to reach a loss. This benchmark measures both factors on
tasks with real learning signal and reports their product.

Tasks (2 ranks, DDP, real text that ships with every CPython,
``pydoc_data.topics``: the Python language reference, 79 topics, 465 kB):

* ``lm``: a byte-level causal transformer language model (d_model 256, 2
  layers, 4 heads, context 64, batch 8 sequences per rank; 1.7M parameters).
  The loss is the validation cross-entropy in nats per byte, on text held out
  (every 10th 4 KiB block).
* ``embedding``: which of the 79 topics a window of 16 words comes from, by
  ``EmbeddingBag(50_000, 64)`` over hashed words (mean), then 64 -> 256 ->
  79; 3.2M parameters, batch 32 windows per rank. A step touches at most 512
  rows of the table, so DDP's dense gradient is mostly exact zeros (the
  sparse-row case). The loss is the cross-entropy on the last 15% of every
  topic's words, held out.
* ``vision``: a 4-layer CNN (3 -> 48 -> 96 -> 192 -> 192 channels, 3x3
  convolutions, the last three with stride 2, average pooling, a linear head;
  0.55M parameters) naming which of 32 regions (a 4 x 4 grid over each of the
  two photographs scikit-learn ships, ``china.jpg`` and ``flower.jpg``) a 16 x
  16 crop comes from, batch 32 crops per rank, training crops flipped at
  random. The loss is the cross-entropy on 1,024 fixed crops (new views of
  the same pixels: it measures how fast training fits, which is what the
  methods change).
* ``code``: a recurrent byte-level model of Python source (embedding 256 ->
  128, a GRU of 256 units, a byte head; 0.40M parameters, context 64, batch
  16 sequences per rank) on 16 modules of the standard library that ships
  with the interpreter (``argparse`` ... ``statistics``, about 650 kB),
  held out as ``lm`` holds its text out. A fourth family, added to test
  ``auto``'s PowerSGD gate on a model it was not set on.
* ``ngram``: a fastText-style classifier (hashed word unigrams into one
  ``EmbeddingBag`` of 50,000 x 32 and hashed word bigrams into another of
  100,000 x 32, their means concatenated into a linear head; 4.8M
  parameters) naming which of the 16 modules of ``code`` a window of 32
  words comes from, batch 64 windows per rank, the last 15% of each module
  held out. Two tables in two buckets, each mostly zeros: a sparse family
  ``auto``'s top-k density was not set on.

Optimizers: ``adamw`` (weight decay 0.01; lr 1e-3 for ``lm`` and ``vision``,
3e-3 for ``embedding``, ``code`` and ``ngram``) and ``sgd`` (momentum 0.9; lr
0.03 for ``lm``, which diverges at 0.1, 0.5 for ``embedding`` and ``ngram``,
0.02 for ``vision`` and 0.1 for ``code``).

Methods: ``none`` (DDP's allreduce), xcomm's hooks ``bf16``, ``int8``,
``topk`` (1%, error feedback), ``topk-tensor`` (the same, selected per
tensor: ``TopKState(per_tensor=True)``), ``powersgd`` (rank 4, error feedback),
``auto`` (the hook's default: none, bf16, int8 and top-k, each lossy one
only on a bucket where it drops at most 1% of the step's gradient, and
PowerSGD only where its step gate opens), ``auto-any`` (the same over every
method: fp16 too),
``auto-any-step`` (every method chosen by time per step: what the objective
guards against) and ``backend-auto`` (``xcomm.Options(compression="auto")``).

Measured in two phases, then combined:

1. **Steps to target**, once per task, optimizer and static method, on
   loopback (a static method's arithmetic does not depend on the link): the
   validation loss every ``--eval-every`` steps (each rank evaluates half
   the held-out set; the losses are all-reduced), averaged over the last
   ``--smooth`` evaluations so one lucky evaluation does not decide. The
   uncompressed run trains ``--steps`` steps; the target is its smoothed
   loss at ``--target-at`` of them. Every other run trains until its
   smoothed loss reaches the target, for at most ``--max-steps`` (default
   3x ``--steps``: a method may need several times the steps and still win
   on time). With ``--seeds N`` every static method trains N times, from N
   initial weights and batch orders, to the same target, and its steps to
   target are the mean: where a curve crosses is partly the chance of one
   trajectory (on the LM with seed 0, uncompressed training crossed at step
   300, bf16 at 277 and int8 at 279, though bf16 and int8 drop under 0.001%
   of each step's gradient), and a method compared by one seed is credited
   or charged with it.
2. **Step time** per link rate on 2 emulated nodes (``nodes=2``, root): each
   static method trains ``--warmup`` + ``--timed-steps`` steps in a process
   pair of its own, evaluating as a training run does; the mean over the
   timed steps. That is how the autos run: they choose by the link, so each
   runs its whole training at each rate, and its steps to target and its
   wall time to reach it come from that run (round r trains seed r mod
   N, and its steps to target are the mean over the rounds). (Timing every static method's
   model in one process pair, interleaved in blocks of 5 steps, read top-k's
   and PowerSGD's steps at 0.1 Gbit/s 15-20% faster than the same methods
   take training on their own; int8's alike.) Process pairs of the same
   method differ by up to 10% on a 2-core machine, more than the methods
   differ at fast rates, so all of this is done ``--rounds`` times: in each
   round every method runs once, in an order rotated from the last round's,
   and a row reports the round with the median time to target and the
   fastest and slowest rounds beside it.

Steps to target are where the smoothed validation loss crosses the target,
interpolated linearly between the two evaluations around the crossing (an
evaluation interval is 7% of the LM's steps to target: the first evaluation
under the target alone would charge a method up to that for steps it did
not take). Time to target = steps to target x mean step time, where the first 2 steps
of int8, top-k and PowerSGD take uncompressed's step time (their hooks
reduce them uncompressed, as every auto does; the autos: the sum of their
measured step times up to that step). Evaluation is not timed. A method that
does not reach the target in ``--max-steps`` steps shows ``>`` its bound.
Writes ``time_to_accuracy.{json,md,png}``, and each job's result under
``runs/``, which a later run with the same settings reuses (``--fresh`` runs
everything again).

Example (root; 2 emulated nodes)::

    python -m xcomm_bench time-to-accuracy --tasks lm,embedding,vision --optimizers adamw \\
        --rates 0.1gbit,1gbit,10gbit --out bench-results/tta
    python -m xcomm_bench time-to-accuracy --smoke   # loopback, tiny models, seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .launch import module_command, run_ranks

__all__ = [
    "METHODS",
    "STATIC_METHODS",
    "TASKS",
    "TaskSpec",
    "build_task",
    "crossing_step",
    "main",
    "steps_to_target",
]

TASKS: tuple[str, ...] = ("lm", "embedding", "vision", "code", "ngram")
OPTIMIZERS: tuple[str, ...] = ("adamw", "sgd")
#: Methods whose arithmetic does not depend on the link: steps measured once.
STATIC_METHODS: tuple[str, ...] = ("none", "bf16", "int8", "topk", "topk-tensor", "powersgd")
#: Methods that choose by the link: trained at every rate.
ADAPTIVE_METHODS: tuple[str, ...] = ("auto", "auto-any", "auto-any-step", "backend-auto")
METHODS: tuple[str, ...] = STATIC_METHODS + ADAPTIVE_METHODS
_START_ITER = 2  # compressed methods reduce the first steps uncompressed
# The static methods whose hooks do that (start_iter / start_powerSGD_iter).
_WARMS_UP = ("int8", "topk", "topk-tensor", "powersgd")


# ----------------------------------------------------------------------------- data


def _topics() -> list[str]:
    """The Python language reference's topics, in a fixed order."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


@dataclasses.dataclass
class TaskSpec:
    """A model, its training batches and its validation loss.

    Attributes:
        name: One of :data:`TASKS`.
        build: A fresh module (seed it first).
        batch: ``batch(generator) -> (inputs, targets)`` for one rank's step.
        loss: ``loss(module(inputs), targets)``.
        validation: The held-out ``(inputs, targets)``, the same on every rank.
    """

    name: str
    build: Callable[[], torch.nn.Module]
    batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    validation: tuple[torch.Tensor, torch.Tensor]


class _ByteLM(torch.nn.Module):
    """Byte embedding + causal transformer encoder + byte head."""

    def __init__(self, d_model: int, heads: int, layers: int, context: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, d_model)
        self.pos = torch.nn.Parameter(torch.zeros(context, d_model))
        layer = torch.nn.TransformerEncoderLayer(
            d_model, heads, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True
        )
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(d_model, 256)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(context))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        h = self.embed(tokens) + self.pos[:n]
        return self.head(self.encoder(h, mask=self.mask[:n, :n], is_causal=True))


def _byte_blocks(text: bytes, block: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """(training bytes, held-out bytes): every 10th ``block`` is held out."""
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    blocks = data[: len(data) // block * block].view(-1, block)
    held_out = torch.arange(len(blocks)) % 10 == 9
    return blocks[~held_out].reshape(-1), blocks[held_out].reshape(-1)


def _next_byte_task(
    train: torch.Tensor, held: torch.Tensor, context: int, bs: int, windows: int
) -> tuple[Callable[..., Any], Callable[..., torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Next-byte prediction over ``context`` bytes: (batch, loss, validation),
    the validation ``windows`` fixed windows of ``held``."""

    def at(data: torch.Tensor, starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.stack([data[i : i + context] for i in starts])
        y = torch.stack([data[i + 1 : i + context + 1] for i in starts])
        return x, y

    g = torch.Generator().manual_seed(7)
    validation = at(held, torch.randint(len(held) - context - 1, (windows,), generator=g).tolist())

    def batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return at(train, torch.randint(len(train) - context - 1, (bs,), generator=gen).tolist())

    def loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))

    return batch, loss, validation


def _lm_task(smoke: bool) -> TaskSpec:
    d, heads, layers, context, bs = (32, 2, 1, 16, 4) if smoke else (256, 4, 2, 64, 8)
    text = "\n\n".join(_topics()).encode("utf-8", "replace")
    train, held = _byte_blocks(text)
    batch, loss, validation = _next_byte_task(train, held, context, bs, 8 if smoke else 48)
    return TaskSpec("lm", lambda: _ByteLM(d, heads, layers, context), batch, loss, validation)


def _windows_by_source(
    sources: list[torch.Tensor], window: int, batch: int, held_out: int
) -> tuple[
    Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]],
    tuple[torch.Tensor, torch.Tensor],
]:
    """Windows of ``window`` ids labelled by the source they come from: the
    training batches (``batch`` windows from the sources' first 85%) and
    ``held_out`` fixed validation windows from the rest (at least one window
    per source). Sources are drawn in proportion to their length, as a
    window of the whole text would be."""
    cut = [int(len(w) * 0.85) for w in sources]
    train = [w[:c] for w, c in zip(sources, cut, strict=True)]
    held = [w[c - window :] for w, c in zip(sources, cut, strict=True)]
    train_weight = torch.tensor([float(len(w) - window) for w in train])
    held_weight = torch.tensor([float(len(w) - window + 1) for w in held])

    def draw(parts: list[torch.Tensor], weight: torch.Tensor, n: int, gen: torch.Generator):
        source = torch.multinomial(weight, n, replacement=True, generator=gen)
        xs = []
        for t in source.tolist():
            s = int(torch.randint(len(parts[t]) - window + 1, (1,), generator=gen))
            xs.append(parts[t][s : s + window])
        return torch.stack(xs), source

    validation = draw(held, held_weight, held_out, torch.Generator().manual_seed(7))
    return (lambda gen: draw(train, train_weight, batch, gen)), validation


def _embedding_task(smoke: bool) -> TaskSpec:
    rows, dim, hidden, window, bs = (2000, 8, 16, 8, 8) if smoke else (50_000, 64, 256, 16, 32)
    words = [
        torch.tensor([zlib.crc32(w.encode()) % rows for w in re.findall(r"\w+", t.lower())])
        for t in _topics()
    ]
    words = [w for w in words if len(w) >= 2 * window]
    classes = len(words)
    batch, val = _windows_by_source(words, window, bs, 64 if smoke else 1024)

    def build() -> torch.nn.Module:
        return torch.nn.Sequential(
            torch.nn.EmbeddingBag(rows, dim, mode="mean"),
            torch.nn.Linear(dim, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, classes),
        )

    return TaskSpec("embedding", build, batch, torch.nn.functional.cross_entropy, val)


def _vision_task(smoke: bool) -> TaskSpec:
    # The two photographs scikit-learn ships (china.jpg, flower.jpg; 427 x 640
    # RGB): which of a 4 x 4 grid of regions of which photograph a 16 x 16
    # crop shows, 32 classes. Crops lie anywhere in their region (training's
    # flipped at random), so held-out crops are new views of the same pixels:
    # the loss measures how fast training fits, which is what the methods change.
    from sklearn.datasets import load_sample_images

    grid, crop, bs = 4, 16, 32
    width = (8, 16, 16) if smoke else (48, 96, 192)
    images = [torch.from_numpy(im.copy()) for im in load_sample_images().images]
    photos = torch.stack(images).permute(0, 3, 1, 2).float().div_(255.0)  # (2, 3, 427, 640)
    photos = (photos - photos.mean((0, 2, 3), keepdim=True)) / photos.std((0, 2, 3), keepdim=True)
    cell_h, cell_w = photos.shape[2] // grid, photos.shape[3] // grid
    classes = photos.shape[0] * grid * grid

    def crops(n: int, flips: bool, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        label = torch.randint(classes, (n,), generator=gen)
        dy = torch.randint(cell_h - crop + 1, (n,), generator=gen)
        dx = torch.randint(cell_w - crop + 1, (n,), generator=gen)
        flip = torch.rand(n, generator=gen) < (0.5 if flips else 0.0)
        xs = []
        for c, y, x, f in zip(label.tolist(), dy.tolist(), dx.tolist(), flip.tolist(), strict=True):
            image, cell = divmod(c, grid * grid)
            top, left = cell // grid * cell_h + y, cell % grid * cell_w + x
            patch = photos[image, :, top : top + crop, left : left + crop]
            xs.append(patch.flip(-1) if f else patch)
        return torch.stack(xs), label

    val = crops(64 if smoke else 1024, False, torch.Generator().manual_seed(7))

    def build() -> torch.nn.Module:
        a, b, c = width
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, a, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.Conv2d(a, b, 3, stride=2, padding=1),
            torch.nn.ReLU(),
            torch.nn.Conv2d(b, c, 3, stride=2, padding=1),
            torch.nn.ReLU(),
            torch.nn.Conv2d(c, c, 3, stride=2, padding=1),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(c, classes),
        )

    return TaskSpec(
        "vision",
        build,
        lambda gen: crops(bs, True, gen),
        torch.nn.functional.cross_entropy,
        val,
    )


_CODE_MODULES = (
    "argparse",
    "difflib",
    "textwrap",
    "string",
    "heapq",
    "bisect",
    "fractions",
    "calendar",
    "csv",
    "shlex",
    "pprint",
    "dataclasses",
    "functools",
    "enum",
    "ipaddress",
    "statistics",
)


class _ByteGRU(torch.nn.Module):
    """Byte embedding + one GRU layer + byte head."""

    def __init__(self, embed: int, hidden: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, embed)
        self.gru = torch.nn.GRU(embed, hidden, batch_first=True)
        self.head = torch.nn.Linear(hidden, 256)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.gru(self.embed(tokens))[0])


def _code_task(smoke: bool) -> TaskSpec:
    import importlib.util

    embed, hidden, context, bs = (16, 32, 16, 4) if smoke else (128, 256, 64, 16)
    sources = []
    for module in _CODE_MODULES:
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin is not None
        sources.append(Path(spec.origin).read_bytes())
    train, held = _byte_blocks(b"\n\n".join(sources))
    batch, loss, validation = _next_byte_task(train, held, context, bs, 8 if smoke else 64)
    return TaskSpec("code", lambda: _ByteGRU(embed, hidden), batch, loss, validation)


class _NgramBags(torch.nn.Module):
    """Hashed unigram and bigram bags (fastText's features) + a linear head."""

    def __init__(self, unigrams: int, bigrams: int, dim: int, classes: int) -> None:
        super().__init__()
        self.unigrams = torch.nn.EmbeddingBag(unigrams, dim, mode="mean")
        self.bigrams = torch.nn.EmbeddingBag(bigrams, dim, mode="mean")
        self.head = torch.nn.Linear(2 * dim, classes)
        self.bigram_rows = bigrams

    def forward(self, words: torch.Tensor) -> torch.Tensor:
        # A bigram's row: its two words' hashes mixed (words are hashed rows already).
        pairs = (words[:, :-1] * 1_000_003 + words[:, 1:]) % self.bigram_rows
        return self.head(torch.cat([self.unigrams(words), self.bigrams(pairs)], dim=1))


def _ngram_task(smoke: bool) -> TaskSpec:
    import importlib.util

    unigrams, bigrams, dim, window, bs = (
        (2000, 4000, 8, 8, 8) if smoke else (50_000, 100_000, 32, 32, 64)
    )
    words = []
    for module in _CODE_MODULES:
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin is not None
        text = Path(spec.origin).read_text()
        words.append(
            torch.tensor([zlib.crc32(w.encode()) % unigrams for w in re.findall(r"\w+", text)])
        )
    classes = len(words)
    batch, val = _windows_by_source(words, window, bs, 64 if smoke else 1024)
    return TaskSpec(
        "ngram",
        lambda: _NgramBags(unigrams, bigrams, dim, classes),
        batch,
        torch.nn.functional.cross_entropy,
        val,
    )


def build_task(name: str, *, smoke: bool = False) -> TaskSpec:
    """The benchmark's tasks; ``smoke`` shrinks the models to seconds of training.

    Example::

        >>> task = build_task("embedding", smoke=True)
        >>> x, y = task.batch(torch.Generator().manual_seed(0))
        >>> task.loss(task.build()(x), y).ndim
        0
    """
    if name == "lm":
        return _lm_task(smoke)
    if name == "embedding":
        return _embedding_task(smoke)
    if name == "vision":
        return _vision_task(smoke)
    if name == "code":
        return _code_task(smoke)
    if name == "ngram":
        return _ngram_task(smoke)
    raise ValueError(f"unknown task {name!r}; known: {', '.join(TASKS)}")


def _optimizer(name: str, task: str, params: Any) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(
            params, lr=3e-3 if task in ("embedding", "code", "ngram") else 1e-3, weight_decay=0.01
        )
    if name == "sgd":
        lr = {"lm": 0.03, "embedding": 0.5, "vision": 0.02, "code": 0.1, "ngram": 0.5}[task]
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    raise ValueError(f"unknown optimizer {name!r}; known: {', '.join(OPTIMIZERS)}")


# ----------------------------------------------------------------------------- one rank


def _counted(hook):  # type: ignore[no-untyped-def]
    """``hook`` with a call count (``_counted.calls``): proof that it ran."""

    def wrapper(state, bucket):  # type: ignore[no-untyped-def]
        wrapper.calls += 1
        return hook(state, bucket)

    wrapper.calls = 0
    return wrapper


class _Trainer:
    """One DDP model with one method registered, its optimizer and its batches."""

    def __init__(
        self, spec: TaskSpec, optimizer: str, method: str, rank: int, seed: int = 0
    ) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        import xcomm
        from xcomm import hooks
        from xcomm.hooks import auto as auto_methods

        group = dist.group.WORLD
        if method == "backend-auto":
            ranks = list(range(dist.get_world_size()))
            group = dist.new_group(
                ranks, backend="xcomm", pg_options=xcomm.Options(compression="auto")
            )
        # The same initial weights for every method and rank (of one seed).
        torch.manual_seed(1234 + seed)
        self.method, self.spec = method, spec
        self.model = DDP(spec.build(), process_group=group, gradient_as_bucket_view=True)
        self.state: Any = None
        self.hook: Any = None
        if method == "backend-auto":
            self.state = group._get_backend(torch.device("cpu"))
        elif method != "none":

            def any_method(objective: str) -> Any:  # auto among every method
                return hooks.AutoState(
                    process_group=group,
                    methods=auto_methods.METHODS,
                    min_density=0.01,
                    start_iter=_START_ITER,
                    objective=objective,
                )

            hook_of = {
                "bf16": (lambda: hooks.CastState(process_group=group), hooks.bf16_cast_hook),
                "int8": (
                    lambda: hooks.Int8State(process_group=group, start_iter=_START_ITER),
                    hooks.int8_compress_hook,
                ),
                "topk": (
                    lambda: hooks.TopKState(
                        process_group=group, density=0.01, start_iter=_START_ITER
                    ),
                    hooks.topk_hook,
                ),
                "topk-tensor": (
                    lambda: hooks.TopKState(
                        process_group=group, density=0.01, start_iter=_START_ITER, per_tensor=True
                    ),
                    hooks.topk_hook,
                ),
                "powersgd": (
                    lambda: hooks.PowerSGDState(
                        process_group=group,
                        matrix_approximation_rank=4,
                        start_powerSGD_iter=_START_ITER,
                    ),
                    hooks.powersgd_hook,
                ),
                "auto": (
                    lambda: hooks.AutoState(process_group=group, start_iter=_START_ITER),
                    hooks.auto_hook,
                ),
                "auto-any": (lambda: any_method("time_to_accuracy"), hooks.auto_hook),
                "auto-any-step": (lambda: any_method("step_time"), hooks.auto_hook),
            }
            make_state, hook = hook_of[method]
            self.state, self.hook = make_state(), _counted(hook)
            self.model.register_comm_hook(self.state, self.hook)
        self.optimizer = _optimizer(optimizer, spec.name, self.model.parameters())
        self.gen = torch.Generator().manual_seed(100 + rank + 1000 * seed)
        self.steps = 0
        self.gates: list[list[Any]] = []

    def step(self) -> float:
        """One training step; returns its wall seconds."""
        x, y = self.spec.batch(self.gen)
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=False)
        self.spec.loss(self.model(x), y).backward()
        self.optimizer.step()
        self.steps += 1
        elapsed = time.perf_counter() - start
        gate = getattr(self.state, "powersgd_gate", None)
        if gate is not None and (not self.gates or self.gates[-1][1:4] != list(gate)):
            # auto's PowerSGD gate at each evaluation: step, open, S_with, S_without,
            # the step time it charged by, the methods then
            self.gates.append(
                [
                    self.steps,
                    *gate,
                    self.state.charged_step_seconds,
                    ",".join(self.state.methods_by_bucket()),
                ]
            )
        return elapsed

    def validation_loss(self) -> float:
        """The mean loss over the held-out set, each rank evaluating its share."""
        rank, world = dist.get_rank(), dist.get_world_size()
        with torch.no_grad():
            x, y = (t[rank::world] for t in self.spec.validation)
            logits = self.model.module(x)
            total = self.spec.loss(logits, y) * y.numel()
        summed = torch.tensor([float(total), float(y.numel())], dtype=torch.float64)
        dist.all_reduce(summed)
        return float(summed[0] / summed[1])

    def proof(self) -> dict[str, Any]:
        """What shows the method ran: hook calls, auto's choices, the backend's counts."""
        out: dict[str, Any] = {"hook_calls": getattr(self.hook, "calls", 0)}
        if self.method.startswith("auto"):
            out["chosen"] = ",".join(self.state.methods_by_bucket())
            # A run that ends on one method may have run others on the way.
            out["switches"] = self.state.switches
            out["gates"] = self.gates
        if self.method == "backend-auto":
            chosen = self.state.compression_stats.get("auto", {}).get("chosen", {})
            out["chosen"] = ",".join(f"{m}*{n}" for m, n in chosen.items() if n)
        return out


@dataclasses.dataclass
class WorkerJob:
    """What one process pair does (its command line, as JSON).

    Train ``methods[0]`` for at most ``steps`` steps, evaluating every
    ``eval_every``, and stop once the mean of the last ``smooth``
    evaluations is at or below ``target`` (if given). ``seed`` draws the
    initial weights and the batches (0: as before seeds existed).
    """

    task: str
    optimizer: str
    methods: list[str]
    steps: int = 0
    eval_every: int = 20
    smooth: int = 3
    target: float | None = None
    smoke: bool = False
    seed: int = 0


def _worker(job: WorkerJob, out: str) -> int:
    import xcomm

    torch.set_num_threads(1)
    opts = xcomm.Options(timeout=datetime.timedelta(seconds=600))
    dist.init_process_group("xcomm", init_method="env://", pg_options=opts)
    try:
        rank = dist.get_rank()
        spec = build_task(job.task, smoke=job.smoke)
        trainers = [_Trainer(spec, job.optimizer, m, rank, job.seed) for m in job.methods]
        (t,) = trainers
        history, times = [], []
        for step in range(job.steps + 1):
            if step % job.eval_every == 0 or step == job.steps:
                history.append((step, t.validation_loss()))
                if job.target is not None and smoothed(history, job.smooth)[-1][1] <= job.target:
                    break  # every rank sees the same (all-reduced) losses
            if step < job.steps:
                times.append(t.step())
        result = {"history": history, "step_s": times, "seed": job.seed, **t.proof()}
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    return 0


def _launch(
    job: WorkerJob,
    rate: str | None,
    timeout: float,
    cache: Path | None = None,
    round_: int = 0,
) -> dict[str, Any]:
    """Runs ``job`` on 2 ranks: loopback (``rate=None``) or 2 emulated nodes.
    With ``cache``, a result kept there by an earlier run of the same job
    (and round) is reused, and a new one kept (a long sweep can be resumed
    or extended)."""
    name = f"train-{job.task}-{job.optimizer}-{'+'.join(job.methods)}-{rate or 'loopback'}"
    name += f"-{job.steps}x{job.eval_every}-smooth{job.smooth}"
    name += "" if job.target is None else f"-to{job.target:.6f}"
    name += f"-round{round_ + 1}" if round_ else ""
    name += f"-seed{job.seed}" if job.seed else ""
    kept = None if cache is None else cache / f"{name}{'-smoke' if job.smoke else ''}.json"
    if kept is not None and kept.exists():
        return json.loads(kept.read_text())
    result = _run_job(job, rate, timeout)
    if kept is not None:
        kept.parent.mkdir(parents=True, exist_ok=True)
        kept.write_text(json.dumps(result))
    return result


def _run_job(job: WorkerJob, rate: str | None, timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        argv = ["--worker", out, "--job", json.dumps(dataclasses.asdict(job))]
        command = module_command("xcomm_bench.time_to_accuracy", *argv)
        # On loopback, both ranks share a host, where xcomm would reduce through
        # shared memory: this benchmark is about the network, as the emulated
        # nodes are separate hosts.
        env = {"XCOMM_SHM": "0"}
        rc = run_ranks(command, 2, nodes=2 if rate else 0, rate=rate, env=env, timeout=timeout)
        if rc != 0:
            raise RuntimeError(
                f"{job.task}/{job.optimizer} {job.methods} at {rate}: ranks failed ({rc})"
            )
        return json.loads(Path(out).read_text())


# ----------------------------------------------------------------------------- combining


def smoothed(history: Sequence[Sequence[float]], window: int) -> list[tuple[int, float]]:
    """``(step, mean of the last window evaluations' losses)`` for each
    evaluation: the crossing of a target is then not decided by one lucky
    evaluation (every method's curve lags alike)."""
    out = []
    for i, (step, _) in enumerate(history):
        recent = [loss for _, loss in history[max(0, i - window + 1) : i + 1]]
        out.append((int(step), sum(recent) / len(recent)))
    return out


def target_loss(history: Sequence[Sequence[float]], at_fraction: float, window: int = 1) -> float:
    """The smoothed loss at the evaluation nearest ``at_fraction`` of the run."""
    curve = smoothed(history, window)
    last = curve[-1][0]
    return min(curve, key=lambda c: abs(c[0] - at_fraction * last))[1]


def steps_to_target(
    history: Sequence[Sequence[float]], target: float, window: int = 1
) -> int | None:
    """The first evaluated step whose smoothed loss is at or below ``target``.

    Example::

        >>> steps_to_target([(0, 5.0), (10, 3.0), (20, 3.5), (30, 2.0)], 2.5)
        30
        >>> steps_to_target([(0, 5.0), (10, 3.0), (20, 2.0)], 2.6, window=2)
        20
        >>> steps_to_target([(0, 5.0), (10, 3.0)], 2.5) is None
        True
    """
    return next((s for s, loss in smoothed(history, window) if loss <= target), None)


def crossing_step(
    history: Sequence[Sequence[float]], target: float, window: int = 1
) -> float | None:
    """Where the smoothed loss curve crosses ``target``: linearly
    interpolated between the last evaluation above it and the first at or
    below it (that first evaluation's step when the curve starts below).

    Evaluations are ``--eval-every`` steps apart (20 here, 7% of a 280-step
    run), so the first evaluation at or below a target marks its crossing
    only to within an evaluation interval: a method that crosses just after
    an evaluation is charged up to 20 steps it did not take, and two methods
    whose curves cross a step apart can read an interval apart. The
    interpolated step is the same estimate of the crossing for every method.

    Example::

        >>> crossing_step([(0, 5.0), (10, 3.0), (20, 2.0)], 2.5)
        15.0
        >>> crossing_step([(0, 5.0), (10, 3.0)], 2.5) is None
        True
    """
    curve = smoothed(history, window)
    for i, (step, loss) in enumerate(curve):
        if loss <= target:
            if i == 0:
                return float(step)
            before_step, before = curve[i - 1]
            return before_step + (before - target) / (before - loss) * (step - before_step)
    return None


def _time_of_steps(step_s: Sequence[float], steps: float) -> float:
    """The seconds of a run's first ``steps`` steps (a fraction of the next
    step's for a fractional count)."""
    whole = min(int(steps), len(step_s))
    rest = step_s[whole] * (steps - whole) if whole < len(step_s) else 0.0
    return sum(step_s[:whole]) + rest


def _rounds(value: dict[str, Any] | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A method's rounds at one rate: a list (or one result, as results from
    before rounds were kept)."""
    return value if isinstance(value, list) else [value]


def _median_index(values: Sequence[float]) -> int:
    """The index of the (lower) median of ``values``: a row reports that
    round, so its parts (steps, step time, method chosen) belong together."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    return order[(len(order) - 1) // 2]


def combine(
    trained: dict[str, dict[str, Any]],
    timed: dict[str, dict[str, Any]],
    adaptive: dict[str, dict[str, Any]],
    target_at: float,
    steps: int,
    window: int = 1,
) -> list[dict[str, Any]]:
    """Rows ``{rate, method, steps, step_ms, time_s, reached, ...}`` of one task and optimizer.

    ``trained``: static method -> its training runs, one per seed (a list;
    or one run, as results from before seeds were kept); ``timed``: rate ->
    method -> its timing rounds (a list of runs, each its timed
    ``step_s``); ``adaptive``: rate -> method -> its training runs at that
    rate (a list, one per round). ``steps``: the bound of a method that did
    not reach the target; ``window``: evaluations averaged.

    Steps to target are where the smoothed curve crosses the target,
    interpolated between evaluations (:func:`crossing_step`), averaged over
    a static method's seeds and over an adaptive method's rounds (each round
    trains a seed of its own where there are several): which step a curve
    crosses at is partly chance (the trajectory of one seed), and methods
    that lose nothing, or nearly, differ by it alone (on the LM, 277 to 300
    steps with seed 0). Each round gives a time to target: those steps x
    that round's seconds per step (a static method's mean timed step; an
    adaptive method's measured time to its own crossing over its steps, the
    uncompressed first steps and every switch included). A row reports the
    round with the median time, and ``time_min_s``/``time_max_s`` over the
    rounds: the spread between process pairs, which a ratio must clear to
    mean something.
    """
    target = target_loss(_rounds(trained["none"])[0]["history"], target_at, window)
    rows = []

    def means(rate: str, method: str) -> list[float]:
        return [sum(r["step_s"]) / len(r["step_s"]) for r in _rounds(timed[rate][method])]

    def median(values: Sequence[float]) -> float:
        return values[_median_index(values)]

    for rate in timed:
        none_s = median(means(rate, "none"))
        for method, runs in trained.items():
            reached = [crossing_step(r["history"], target, window) for r in _rounds(runs)]
            upto = sum(n if n is not None else steps for n in reached) / len(reached)
            # Its first steps went uncompressed, as the hook runs them (the
            # autos' times are their real steps, which include them too).
            warm = min(upto, _START_ITER) if method in _WARMS_UP else 0
            step_means = means(rate, method)
            times = [upto * m + warm * (none_s - m) for m in step_means]
            i = _median_index(times)
            rows.append(
                {
                    "rate": rate,
                    "method": method,
                    "target": target,
                    "steps": upto,
                    "reached": None not in reached,
                    "seeds": len(reached),
                    "step_ms": 1e3 * step_means[i],
                    "time_s": times[i],
                    "time_min_s": min(times),
                    "time_max_s": max(times),
                    "rounds": len(times),
                    "hook_calls": _rounds(timed[rate][method])[i]["hook_calls"],
                }
            )
        for method, value in adaptive.get(rate, {}).items():
            runs = _rounds(value)
            reached = [crossing_step(run["history"], target, window) for run in runs]
            upto = [n if n is not None else steps for n in reached]
            per_step = [
                _time_of_steps(run["step_s"], u) / u if u else 0.0
                for run, u in zip(runs, upto, strict=True)
            ]
            mean_upto = sum(upto) / len(upto)
            times = [mean_upto * s for s in per_step]
            i = _median_index(times)
            run = runs[i]
            rows.append(
                {
                    "rate": rate,
                    "method": method,
                    "target": target,
                    "steps": mean_upto,
                    "reached": None not in reached,
                    "seeds": len({r.get("seed", 0) for r in runs}),
                    "step_ms": 1e3 * per_step[i],
                    "time_s": times[i],
                    "time_min_s": min(times),
                    "time_max_s": max(times),
                    "rounds": len(times),
                    "hook_calls": run["hook_calls"],
                    "chosen": run.get("chosen", ""),
                    "switches": run.get("switches", 0),
                    # What every round ended on: a choice that differs between
                    # rounds is part of the spread.
                    "chosen_by_round": [r.get("chosen", "") for r in runs],
                }
            )
    for r in rows:
        same = [o for o in rows if o["rate"] == r["rate"]]
        none = next(o for o in same if o["method"] == "none")
        # A method that did not reach the target has a bound, not a time: not a contender.
        reached = [o for o in same if o["method"] in STATIC_METHODS and o["reached"]]
        best = min(reached, key=lambda o: o["time_s"])
        r["vs_none"] = r["time_s"] / none["time_s"]
        r["vs_best_static"] = r["time_s"] / best["time_s"]
        r["best_static"] = best["method"]
    return rows


def format_markdown(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        (
            "| task | optimizer | rate | method | steps to target | ms/step | time to target s "
            "| rounds: min-max s | / none | / best static |"
        ),
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        bound = "" if r["reached"] else ">"
        chosen = r.get("chosen", "")
        if r.get("switches"):
            chosen += f"; {r['switches']} switches"
        method = r["method"] + (f" ({chosen})" if chosen else "")
        spread = f"{r.get('time_min_s', r['time_s']):.2f}-{r.get('time_max_s', r['time_s']):.2f}"
        lines.append(
            f"| {r['task']} | {r['optimizer']} | {r['rate']} | {method} | {bound}{r['steps']:.0f} "
            f"| {r['step_ms']:.1f} | {bound}{r['time_s']:.2f} | {r.get('rounds', 1)}: {spread} "
            f"| {bound}{r['vs_none']:.2f} | {bound}{r['vs_best_static']:.2f} |"
        )
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(results["cases"])
    fig, axes = plt.subplots(len(keys), 2, figsize=(11, 3.6 * len(keys)), dpi=100, squeeze=False)
    for (curves_ax, time_ax), key in zip(axes, keys, strict=True):
        case = results["cases"][key]
        for method, runs in case["trained"].items():
            run = _rounds(runs)[0]  # seed 0
            s, loss = zip(*smoothed(run["history"], results["config"]["smooth"]), strict=True)
            curves_ax.plot(s, loss, label=method, linewidth=1.2)
        curves_ax.axhline(case["rows"][0]["target"], color="grey", linestyle=":", label="target")
        curves_ax.set_xlabel("step")
        curves_ax.set_ylabel("validation loss (smoothed)")
        curves_ax.set_title(f"{key}: loss per step (loopback, seed 0)")
        curves_ax.legend(fontsize=7)
        curves_ax.grid(alpha=0.3)
        rates = list(dict.fromkeys(r["rate"] for r in case["rows"]))
        x = [_rate_gbit(r) for r in rates]
        for method in dict.fromkeys(r["method"] for r in case["rows"]):
            at = [
                next(o for o in case["rows"] if o["rate"] == rate and o["method"] == method)
                for rate in rates
            ]
            y = [o["time_s"] for o in at]
            # The bars: the fastest and slowest round (one round: no bar).
            spread = [
                [o["time_s"] - o.get("time_min_s", o["time_s"]) for o in at],
                [o.get("time_max_s", o["time_s"]) - o["time_s"] for o in at],
            ]
            style = "o-" if method in STATIC_METHODS else "s--"
            time_ax.errorbar(
                x, y, yerr=spread, fmt=style, label=method, linewidth=1.2, markersize=4, capsize=2
            )
        time_ax.set_xscale("log")
        time_ax.set_yscale("log")
        time_ax.set_xlabel("link rate (Gbit/s)")
        time_ax.set_ylabel("time to target (s)")
        time_ax.set_title(f"{key}: time to target loss")
        time_ax.legend(fontsize=7)
        time_ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _rate_gbit(rate: str) -> float:
    if rate == "loopback":
        return 100.0
    from .cluster import parse_rate

    return parse_rate(rate) / 1e9


# ----------------------------------------------------------------------------- driver


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every phase of every task and optimizer, with a progress bar."""
    from tqdm import tqdm

    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or "none" not in methods:
        raise SystemExit(f"--methods: {unknown} unknown, or 'none' missing; known: {METHODS}")
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {args.rounds}")
    if args.seeds < 1:
        raise SystemExit(f"--seeds must be at least 1, got {args.seeds}")
    static = [m for m in methods if m in STATIC_METHODS]
    adaptive = [m for m in methods if m in ADAPTIVE_METHODS]
    rates: list[str | None] = [r for r in args.rates.split(",") if r] if not args.smoke else [None]
    tasks, optimizers = args.tasks.split(","), args.optimizers.split(",")
    cases = [(t, o) for t in tasks for o in optimizers]
    per_case = args.seeds * len(static) + args.rounds * len(rates) * (len(static) + len(adaptive))
    jobs = len(cases) * per_case
    bar = tqdm(total=jobs, desc="time to accuracy", unit="run", disable=args.no_progress)
    common = {"smoke": args.smoke}
    train = {"eval_every": args.eval_every, "smooth": args.smooth, **common}
    cache = None if args.fresh else Path(args.out) / "runs"
    results: dict[str, Any] = {"config": vars(args), "cases": {}}
    for task, optimizer in cases:
        trained, timed, adaptive_runs = {}, {}, {}
        # Uncompressed first, seed 0: its curve sets the target; every other
        # run (every seed) trains until it reaches it, for at most --max-steps.
        target = None
        for seed in range(args.seeds):
            for method in ["none", *(m for m in static if m != "none")]:
                bar.set_postfix_str(f"{task}/{optimizer} {method} steps, seed {seed}")
                steps = args.steps if target is None else args.max_steps
                job = WorkerJob(
                    task, optimizer, [method], steps=steps, target=target, seed=seed, **train
                )
                trained.setdefault(method, []).append(_launch(job, None, args.timeout, cache))
                if target is None:
                    target = target_loss(trained[method][0]["history"], args.target_at, args.smooth)
                bar.update()
        for rate in rates:
            name = rate or "loopback"
            timed[name] = {m: [] for m in static}
            adaptive_runs[name] = {m: [] for m in adaptive}
            # Every method once per round, each in a process pair of its own,
            # the order rotated between rounds: a slow spell of the machine,
            # or a slow process pair, falls on different methods.
            timed_jobs = [(m, False) for m in static] + [(m, True) for m in adaptive]
            for round_ in range(args.rounds):
                shift = round_ % len(timed_jobs)
                for method, is_adaptive in timed_jobs[shift:] + timed_jobs[:shift]:
                    what = "trained" if is_adaptive else "step time"
                    bar.set_postfix_str(
                        f"{task}/{optimizer} {method} {what} at {name}, round {round_ + 1}"
                    )
                    if is_adaptive:
                        # Each round trains a seed of its own (its steps are
                        # averaged over the rounds as a static method's are
                        # over the seeds).
                        job = WorkerJob(
                            task,
                            optimizer,
                            [method],
                            steps=args.max_steps,
                            target=target,
                            seed=round_ % args.seeds,
                            **train,
                        )
                        got = _launch(job, rate, args.timeout, cache, round_)
                        adaptive_runs[name][method].append(got)
                    else:
                        steps = args.warmup + args.timed_steps
                        job = WorkerJob(task, optimizer, [method], steps=steps, **train)
                        got = _launch(job, rate, args.timeout, cache, round_)
                        timed[name][method].append({**got, "step_s": got["step_s"][args.warmup :]})
                    bar.update()
        rows = combine(trained, timed, adaptive_runs, args.target_at, args.max_steps, args.smooth)
        for r in rows:
            r.update(task=task, optimizer=optimizer)
        results["cases"][f"{task}/{optimizer}"] = {
            "trained": trained,
            "timed": timed,
            "adaptive": adaptive_runs,
            "rows": rows,
        }
    bar.close()
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m xcomm_bench time-to-accuracy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--rates", default="0.1gbit,0.5gbit,1gbit,5gbit,10gbit")
    p.add_argument("--steps", type=int, default=400, help="uncompressed training's steps")
    p.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="the most steps any other run takes to reach the target (default 3 x --steps)",
    )
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--smooth", type=int, default=3, help="evaluations averaged into the curve")
    p.add_argument(
        "--target-at",
        type=float,
        default=0.75,
        help="the target: uncompressed's loss at this fraction of its steps",
    )
    p.add_argument("--warmup", type=int, default=6, help="untimed steps before the timed ones")
    p.add_argument(
        "--timed-steps", type=int, default=30, help="timed steps per static method and rate"
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="times each method is timed at each rate, in rotation, each in a fresh process pair",
    )
    p.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="initial weights and batches each static method trains with on loopback (its "
        "steps to target: the mean); each round of an adaptive method trains the next seed",
    )
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--smoke", action="store_true", help="tiny models on loopback, 20 steps")
    p.add_argument("--out", default="bench-results/time-to-accuracy")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--fresh",
        action="store_true",
        help="run every job again (default: reuse the results kept in OUT/runs)",
    )
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--job", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        return _worker(WorkerJob(**json.loads(args.job)), args.worker)
    if args.smoke:
        args.steps, args.eval_every, args.warmup, args.timed_steps = 20, 5, 2, 4
        args.rounds = min(args.rounds, 2)
    if args.max_steps is None:
        args.max_steps = 3 * args.steps
    results = run(args)
    rows = [r for case in results["cases"].values() for r in case["rows"]]
    table = format_markdown(rows)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "time_to_accuracy.json").write_text(json.dumps(results, indent=1))
    (out / "time_to_accuracy.md").write_text(table + "\n")
    plot(results, out / "time_to_accuracy.png")
    print(f"wrote {out}/time_to_accuracy.{{json,md,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
