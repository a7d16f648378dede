"""Every fenced code block of README.md runs as written, on 2 real ranks, and
does what the README says it does.

Each block is read from README.md at run time and executed unchanged, with only
the glue the README itself states (one line per block in ``BLOCKS``), and is
known by its first line: ``test_every_readme_block_is_run`` fails when the
README gains a block no test here runs (or loses one). The blocks run in three
programs, this file run as a script: ``torchrun`` for the one-line switch, the
DDP hook and the bucketer (``core``: one process group, made by the switch)
and for the accelerate recipe (``accelerate``, as the README launches it), and
``python`` for the Lightning Trainer (Lightning's own launcher starts rank 1).
Each rank saves what it observed; the tests here check it.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dist_harness import run_program

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
RUN_TIMEOUT = 150
STEPS = 14  # the hook block starts PowerSGD at step 10

#: first line of a README block -> (its name, the program that runs it, the glue).
BLOCKS: dict[str, tuple[str, str, str]] = {
    "import xcomm  # registers the backend": (
        "switch",
        "core",
        "torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT) for env://",
    ),
    "from xcomm import hooks": (
        "hooks",
        "core",
        "a DDP `model` on the group the switch made, then training steps",
    ),
    "bucketer = xcomm.GradientBucketer(": (
        "bucketer",
        "core",
        "`xcomm`, `torch`, a plain `model`, `data` (batches), `loss_fn` on the switch's group",
    ),
    "import pytorch_lightning as pl": (
        "lightning",
        "lightning",
        "`trainer.fit(module, loader)` in a script run with `python` (module stops after 2 epochs)",
    ),
    "import torch.distributed as dist": (
        "accelerate",
        "accelerate",
        "`model`, `opt`, `loader` before the block; under torchrun; training steps after it",
    ),
}


def readme_blocks(text: str | None = None) -> list[tuple[str, str, int]]:
    """``(language, code, line of its first code line)`` of every fenced block."""
    text = README.read_text() if text is None else text
    out = []
    for m in re.finditer(r"^```(\S*)\n(.*?)^```\s*$", text, re.MULTILINE | re.DOTALL):
        out.append((m.group(1), m.group(2), text.count("\n", 0, m.start(2)) + 1))
    return out


def _block(name: str) -> tuple[str, int]:
    for lang, code, line in readme_blocks():
        first = code.splitlines()[0] if code.strip() else ""
        if lang == "python" and BLOCKS.get(first, ("",))[0] == name:
            return code, line
    raise AssertionError(f"README.md has no block {name!r}")


def run_block(name: str, namespace: dict[str, Any]) -> dict[str, Any]:
    """Executes README block ``name`` in ``namespace`` (the glue), as written.
    Tracebacks point at README.md's own lines."""
    code, line = _block(name)
    exec(compile("\n" * (line - 1) + code, str(README), "exec"), namespace)  # noqa: S102
    return namespace


# --------------------------------------------------------------------------- #
# Rank side (this file run as a program)
# --------------------------------------------------------------------------- #


def _net() -> nn.Module:
    torch.manual_seed(0)  # the same start on every rank (the bucketer broadcasts nothing)
    return nn.Sequential(
        nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4)
    )


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _dataset(n: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(
        torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g)
    )


def _train(model: nn.Module, opt: torch.optim.Optimizer, rank: int) -> None:
    for step in range(STEPS):
        x, y = _batch(rank, step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _calls() -> dict[str, int]:
    import xcomm

    return {op: s["calls"] for op, s in xcomm.stats().items()}


def core_program(out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    ns = run_block("switch", {})
    import xcomm

    rank = dist.get_rank()
    res: dict[str, Any] = {"backend": dist.get_backend(), "world_size": dist.get_world_size()}
    gloo = dist.new_group(backend="gloo")  # the reference
    xcomm.reset_stats()
    t = torch.arange(1000, dtype=torch.float32) * (rank + 1) + 0.25
    ref = t.clone()
    dist.all_reduce(t)
    dist.all_reduce(ref, group=gloo)
    res["switch"] = {"sum": t, "gloo_sum": ref, "calls": _calls(), "xcomm": ns["xcomm"] is xcomm}

    # hooks: the block's hook on a DDP model over xcomm, against torch's
    # powerSGD_hook (the configuration the block gives) and no hook, on gloo.
    model = DDP(_net())
    hooks = run_block("hooks", {"model": model})["hooks"]
    xcomm.reset_stats()
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1), rank)
    with_torch = DDP(_net(), process_group=gloo)
    with_torch.register_comm_hook(
        torch_psgd.PowerSGDState(gloo, matrix_approximation_rank=4, start_powerSGD_iter=10),
        torch_psgd.powerSGD_hook,
    )
    _train(with_torch, torch.optim.SGD(with_torch.parameters(), lr=0.1), rank)
    plain = DDP(_net(), process_group=gloo)
    _train(plain, torch.optim.SGD(plain.parameters(), lr=0.1), rank)
    code, _ = _block("hooks")
    comments = "\n".join(ln for ln in code.splitlines() if ln.lstrip().startswith("#"))
    named = set(re.findall(r"hooks\.(\w+)", code))
    named |= set(re.findall(r"\b([A-Z]\w*State|\w+_hook)\b", comments))  # the "also:" list
    res["hooks"] = {
        "params": _params(model),
        "torch_params": _params(with_torch),
        "plain_params": _params(plain),
        "calls": _calls(),
        "missing_names": sorted(n for n in named if not hasattr(hooks, n)),
    }

    # bucketer: the block's loop against DDP on gloo with the same SGD.
    model = _net()
    data = [_batch(rank, s) for s in range(4)]
    glue = {"xcomm": xcomm, "torch": torch, "model": model, "data": data}
    glue["loss_fn"] = nn.functional.mse_loss
    xcomm.reset_stats()
    run_block("bucketer", glue)
    ddp = DDP(_net(), process_group=gloo)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for x, y in data:
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    res["bucketer"] = {"params": _params(model), "ddp_params": _params(ddp), "calls": _calls()}
    torch.save(res, f"{out}.rank{rank}.pt")
    dist.destroy_process_group()


def accelerate_program(out: str) -> None:
    import torch.distributed as dist

    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(_dataset(64), batch_size=8)
    ns = run_block("accelerate", {"model": model, "opt": opt, "loader": loader})
    accelerator, model, opt, loader = ns["accelerator"], ns["model"], ns["opt"], ns["loader"]
    import xcomm

    xcomm.reset_stats()
    steps = 0
    for _ in range(2):
        for x, y in loader:
            opt.zero_grad()
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            steps += 1
    res = {
        "backend": dist.get_backend(),
        "accelerate_backend": accelerator.state.backend,
        "is_ddp": isinstance(model, nn.parallel.DistributedDataParallel),
        "world_size": dist.get_world_size(),
        "steps": steps,
        "calls": _calls(),
        "params": _params(accelerator.unwrap_model(model)),
        "start": _params(_net()),
    }
    torch.save(res, f"{out}.rank{accelerator.process_index}.pt")
    accelerator.end_training()


def lightning_program(out: str) -> None:
    ns = run_block("lightning", {})
    pl, trainer = ns["pl"], ns["trainer"]

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def on_train_epoch_end(self) -> None:
            if self.current_epoch >= 1:
                self.trainer.should_stop = True

        def on_fit_end(self) -> None:
            import torch.distributed as dist

            stats = self.trainer.strategy.ddp_comm_state.stats
            res = {
                "backend": dist.get_backend(),
                "world_size": dist.get_world_size(),
                "steps": self.trainer.global_step,
                "hook_calls": stats.calls,
                "hook_ratio": stats.ratio,
                "calls": _calls(),
                "params": _params(self.net),
            }
            torch.save(res, f"{out}.rank{self.global_rank}.pt")

    trainer.fit(Module(), torch.utils.data.DataLoader(_dataset(64), batch_size=8))


# --------------------------------------------------------------------------- #
# Tests
# --------------------------------------------------------------------------- #


def _run(program: str, launcher: list[str], tmp_path: Path) -> list[dict[str, Any]]:
    out = str(tmp_path / program)
    args = [*launcher, str(Path(__file__).resolve()), program, out]
    log = run_program(args, str(tmp_path), RUN_TIMEOUT, f"README blocks ({program})")
    results = [torch.load(f"{out}.rank{r}.pt") for r in range(2)]
    for r in results:
        assert r["backend"] == "xcomm" and r["world_size"] == 2, (r, log[-3000:])
    return results


TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]


def test_every_readme_block_is_run() -> None:
    """A block added to (or removed from) the README fails here until a test runs it."""
    seen: dict[str, int] = {}
    for lang, code, line in readme_blocks():
        first = code.splitlines()[0] if code.strip() else ""
        assert lang == "python", f"README.md:{line}: a ```{lang} block no test runs"
        assert first in BLOCKS, (
            f"README.md:{line}: no test runs the block starting {first!r}; add it to "
            "tests/python/test_readme.py's BLOCKS and check what it does there"
        )
        assert first not in seen, f"README.md:{line} and :{seen[first]} start alike: {first!r}"
        seen[first] = line
    assert set(seen) == set(BLOCKS), f"BLOCKS names blocks the README no longer has: {BLOCKS}"
    ran = {name for name, program, _ in BLOCKS.values() if program in PROGRAMS}
    assert ran == {name for name, _, _ in BLOCKS.values()}


def test_the_block_finder_sees_new_blocks() -> None:
    text = "a\n```python\nx = 1\n```\nb\n```bash\nls\n```\n"
    assert readme_blocks(text) == [("python", "x = 1\n", 3), ("bash", "ls\n", 7)]


@pytest.mark.slow
def test_switch_hook_and_bucketer_blocks(tmp_path: Path) -> None:
    results = _run("core", TORCHRUN, tmp_path)
    for r in results:
        s = r["switch"]
        # the switch made the default group on xcomm; its all_reduce is gloo's, and counted
        assert s["xcomm"] and torch.equal(s["sum"], s["gloo_sum"]), s
        assert s["calls"].get("ALLREDUCE", 0) >= 1, s["calls"]

        h = r["hooks"]
        assert not h["missing_names"], f"the block's comment names {h['missing_names']}"
        # the block's PowerSGD is torch's powerSGD_hook (to float rounding), and lossy:
        # far from the uncompressed run, so PowerSGD did run after step 10
        torch.testing.assert_close(h["params"], h["torch_params"], rtol=1e-4, atol=1e-5)
        assert (h["params"] - h["plain_params"]).abs().max() > 1e-3
        # one allreduce per plain step, then PowerSGD's P and Q on each step from the 10th
        assert h["calls"].get("ALLREDUCE", 0) >= 10 + 2 * (STEPS - 10), h["calls"]

        b = r["bucketer"]
        # the block's loop gives DDP's parameters bit for bit (2 ranks), through the bucketer
        assert torch.equal(b["params"], b["ddp_params"])
        assert b["calls"].get("bucket_allreduce", 0) >= 4, b["calls"]
    assert torch.equal(results[0]["hooks"]["params"], results[1]["hooks"]["params"])


@pytest.mark.slow
def test_accelerate_block(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    results = _run("accelerate", TORCHRUN, tmp_path)
    for r in results:
        # accelerate kept the xcomm group and still reports gloo, as the README says
        assert r["accelerate_backend"] == "gloo" and r["is_ddp"], r
        # the int8 hook's two collectives, on each step after its 2 uncompressed ones
        assert r["steps"] == 8, r
        assert r["calls"].get("ALLTOALL_BASE") == r["steps"] - 2, r["calls"]
        assert r["calls"].get("_ALLGATHER_BASE") == r["steps"] - 2, r["calls"]
        assert not torch.equal(r["params"], r["start"])
    assert torch.equal(results[0]["params"], results[1]["params"])


@pytest.mark.slow
def test_lightning_block(tmp_path: Path) -> None:
    pytest.importorskip("pytorch_lightning")
    results = _run("lightning", [], tmp_path)
    for r in results:
        # XcommStrategy registered the int8 hook on the CPU; it ran every step and compressed
        assert r["steps"] == 8 and r["hook_calls"] == 8, r
        assert r["hook_ratio"] > 1.5, r  # 2 uncompressed steps, then int8
        assert r["calls"].get("ALLTOALL_BASE") == 6, r["calls"]
    assert torch.equal(results[0]["params"], results[1]["params"])


PROGRAMS = {"core": core_program, "accelerate": accelerate_program, "lightning": lightning_program}

if __name__ == "__main__":
    PROGRAMS[sys.argv[1]](sys.argv[2])
