"""xcomm's timeline: Chrome trace-event JSON for chrome://tracing and Perfetto.

While enabled, every collective of an xcomm process group adds a ``transfer``
span on the track "xcomm backend ops", and :class:`xcomm.GradientBucketer`
adds each bucket's ``encode``, ``transfer`` and ``decode`` spans on one track
per stage. The file is ``{"traceEvents": [...]}`` of complete events
(``"ph": "X"``, ``ts``/``dur`` in microseconds of CLOCK_MONOTONIC) with
``pid`` = the rank and one ``tid`` per track, named by ``thread_name``
metadata events; traces of several ranks merge by concatenating their events
(:func:`merge_traces`).

Example::

    >>> import xcomm
    >>> xcomm.enable_timeline()
    >>> # ... train a few steps ...
    >>> xcomm.save_timeline("/tmp/xcomm-rank0.json", pid=0)  # doctest: +SKIP
    >>> xcomm.disable_timeline()
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from . import _C

__all__ = [
    "add_span",
    "clear_timeline",
    "disable_timeline",
    "enable_timeline",
    "merge_traces",
    "now_us",
    "save_timeline",
    "timeline_enabled",
    "timeline_json",
    "validate_trace",
    "when_stream_done",
]


def enable_timeline(clear: bool = True) -> None:
    """Starts recording spans (and, by default, forgets those recorded before)."""
    if clear:
        _C.timeline_clear()
    _C.timeline_set_enabled(True)


def disable_timeline() -> None:
    """Stops recording; what was recorded stays until :func:`clear_timeline`."""
    _C.timeline_set_enabled(False)


def timeline_enabled() -> bool:
    return bool(_C.timeline_enabled())


def clear_timeline() -> None:
    _C.timeline_clear()


def now_us() -> int:
    """The timeline's clock, in microseconds."""
    return int(_C.timeline_now_us())


_waiting: queue.SimpleQueue[tuple[Any, Callable[[int], None]]] | None = None
_waiting_lock = threading.Lock()


def _wait_events(q: queue.SimpleQueue[tuple[Any, Callable[[int], None]]]) -> None:
    while True:
        event, fn = q.get()
        try:
            event.synchronize()
            fn(now_us())
        except Exception:
            logging.getLogger(__name__).exception("xcomm.trace: recording a GPU span failed")


def when_stream_done(device: torch.device, fn: Callable[[int], None]) -> None:
    """Calls ``fn(now_us())`` once the work queued so far on ``device``'s
    current stream has run: at once for a CPU device; for a GPU, from a
    waiter thread when a CUDA event recorded now completes. So a span of a
    GPU op ends when the op does, not when it was queued (a CUDA future
    completes at launch).

    Example::

        >>> import torch, xcomm.trace as trace
        >>> trace.when_stream_done(torch.device("cpu"), lambda t: print(t > 0))
        True
    """
    if device.type != "cuda":
        fn(now_us())
        return
    global _waiting
    with _waiting_lock:
        if _waiting is None:
            _waiting = queue.SimpleQueue()
            threading.Thread(
                target=_wait_events, args=(_waiting,), name="xcomm-trace-events", daemon=True
            ).start()
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    _waiting.put((event, fn))


def add_span(
    name: str,
    category: str,
    track: str,
    start_us: int,
    end_us: int,
    args: Mapping[str, Any] | None = None,
) -> None:
    """Records one complete span (dropped when the timeline is disabled)."""
    if end_us < start_us:
        raise ValueError(
            f"xcomm.add_span: span {name!r} ends ({end_us}) before it starts ({start_us})"
        )
    _C.timeline_add(
        name,
        category,
        track,
        int(start_us),
        int(end_us - start_us),
        {k: str(v) for k, v in (args or {}).items()},
    )


def timeline_json(pid: int = 0) -> dict[str, Any]:
    """The recorded trace as a trace-event dict; ``pid`` is shown as the process (the rank)."""
    return json.loads(_C.timeline_chrome_json(int(pid)))


def save_timeline(path: str | os.PathLike[str], pid: int = 0) -> str:
    """Writes the trace to ``path`` and returns the path."""
    with open(path, "w") as f:
        f.write(_C.timeline_chrome_json(int(pid)))
    return os.fspath(path)


def merge_traces(paths: Iterable[str | os.PathLike[str]], out: str | os.PathLike[str]) -> str:
    """Concatenates the events of per-rank traces (saved with pid = rank) into one file."""
    events: list[dict[str, Any]] = []
    for p in paths:
        with open(p) as f:
            events.extend(json.load(f)["traceEvents"])
    with open(out, "w") as f:
        json.dump({"displayTimeUnit": "ms", "traceEvents": events}, f)
    return os.fspath(out)


_PHASES_NEEDING_DUR = {"X"}
_KNOWN_PHASES = set("BEXiIMCbnesftPOND") | {"(", ")"}


def validate_trace(trace: Any) -> list[str]:
    """Problems that keep ``trace`` from being a valid trace-event file; ``[]`` if none.

    Checks the JSON Object Format of the Trace Event Format spec: a
    ``traceEvents`` list of objects, each with a string ``name`` and a known
    ``ph``; integer ``pid``/``tid``; numeric ``ts`` >= 0 (except metadata);
    ``dur`` >= 0 on complete events; ``args`` an object; metadata events
    named ``process_name``/``thread_name``/... with ``args.name``.
    """
    problems: list[str] = []
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        return ["top level must be an object with a 'traceEvents' list"]
    unit = trace.get("displayTimeUnit", "ms")
    if unit not in ("ms", "ns"):
        problems.append(f"displayTimeUnit must be 'ms' or 'ns', got {unit!r}")
    for i, e in enumerate(trace["traceEvents"]):
        where = f"event {i}"
        if not isinstance(e, dict):
            problems.append(f"{where}: not an object")
            continue
        ph = e.get("ph")
        if ph not in _KNOWN_PHASES:
            problems.append(f"{where}: unknown phase {ph!r}")
        if not isinstance(e.get("name"), str):
            problems.append(f"{where}: 'name' must be a string")
        for key in ("pid", "tid"):
            if not isinstance(e.get(key), int) or isinstance(e.get(key), bool):
                problems.append(f"{where}: {key!r} must be an integer")
        if "args" in e and not isinstance(e["args"], dict):
            problems.append(f"{where}: 'args' must be an object")
        if ph == "M":
            if e.get("name") in ("process_name", "thread_name") and not isinstance(
                e.get("args", {}).get("name"), str
            ):
                problems.append(f"{where}: metadata event needs args.name")
            continue
        ts = e.get("ts")
        if not isinstance(ts, (int, float)) or isinstance(ts, bool) or ts < 0:
            problems.append(f"{where}: 'ts' must be a number >= 0")
        if ph in _PHASES_NEEDING_DUR:
            dur = e.get("dur")
            if not isinstance(dur, (int, float)) or isinstance(dur, bool) or dur < 0:
                problems.append(f"{where}: complete event needs 'dur' >= 0")
    return problems
