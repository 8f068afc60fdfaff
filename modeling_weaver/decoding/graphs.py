"""CUDA-graph plumbing shared by the fixed-shape steps: one capture helper, and steps pipelined one ahead of the host.

Nothing here knows a model: :mod:`.verify`, :mod:`.drafting` and :mod:`.fused` build on it, calling
``graphs.capture_graph`` through this module (so a test can stand a CPU graph in for it in one place).
"""

from __future__ import annotations

import torch


def capture_graph(fn, pool=None, warmup: int = 2, restore=()):
    """Run ``fn`` ``warmup`` times on a side stream (kernel compilation, autotuning, cuBLAS workspaces), then capture
    one call in a CUDA graph. Returns ``(graph, output of the captured call)``.

    ``restore``: tensors ``fn`` advances in place (a step counter, committed state); the warm-ups' changes to them are
    undone, so the first replay starts where the caller left off.
    """
    saved = [x.clone() for x in restore]
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
    finally:  # also when capture fails and the caller goes on eagerly
        for x, y in zip(restore, saved):
            x.copy_(y)
    return graph, out


class HostSlot:
    """A pinned host copy of a captured step's small ``[size]`` long output, and the event that says it is full (off
    CUDA there is none: the copy is complete when it returns)."""

    def __init__(self, device: torch.device, size: int):
        cuda = torch.device(device).type == "cuda"
        self.host = torch.zeros(size, dtype=torch.long, pin_memory=cuda)
        self.event = torch.cuda.Event() if cuda else None

    def fill(self, out: torch.Tensor) -> HostSlot:
        """Queue the copy of ``out`` (ordered before a later replay overwrites it)."""
        self.host.copy_(out, non_blocking=True)
        if self.event is not None:
            self.event.record()
        return self


def read(launched: HostSlot | torch.Tensor) -> list[int]:
    """The values of a launched step: a :class:`HostSlot` once its event has completed, or an eager step's tensor."""
    if isinstance(launched, torch.Tensor):
        return launched.tolist()
    if launched.event is not None:
        launched.event.synchronize()
    return launched.host.tolist()


class PipelinedSteps:
    """Steps whose inputs the previous step left on the device, one CUDA graph each, launched one ahead of the host.

    A subclass gives ``_step()`` (returns a small ``[summary_size]`` long tensor: what the host reads), ``_state()``
    (what a step advances in place) and ``_parse(list)`` (the host side of a summary). :meth:`run` yields the parsed
    summaries; while the host reads step k, step k+1 already runs.
    """

    def __init__(self, device: torch.device, summary_size: int, capture: bool):
        self.capture = capture
        self._graph: tuple | None = None
        # two host slots for summaries, one being read, one being filled (a slot is launched again only after it was
        # read)
        self._host = [HostSlot(device, summary_size) for _ in range(2)]
        self._slot = 0

    def _launch(self) -> HostSlot | torch.Tensor:
        """Start one step; returns what :func:`read` reads (an eager step: its summary itself)."""
        if not self.capture:
            return self._step()
        if self._graph is None:  # a warm-up step advances the state: restored
            self._graph = capture_graph(self._step, warmup=1, restore=self._state())
        self._graph[0].replay()
        slot = self._host[self._slot]
        self._slot = 1 - self._slot
        return slot.fill(self._graph[1])

    def _read(self, launched):
        return self._parse(read(launched))

    @torch.no_grad()
    def run(self, ahead=lambda: True):
        """Steps for as long as the caller iterates, yielding each one's parsed summary.

        Captured steps are pipelined: the next step is launched before this one's summary is read (its inputs are on
        the device already), so the GPU does not wait for the host between steps. ``ahead()`` may veto that (no room
        for one more step in the caches, or this step surely ends the generation); a step launched ahead and never
        read is only wasted work: the caches are reset before the next generation.
        """
        in_flight: list = []
        try:
            while True:
                if not in_flight:
                    in_flight.append(self._launch())
                if self.capture and ahead():
                    in_flight.append(self._launch())
                yield self._read(in_flight.pop(0))
        finally:
            for launched in in_flight:  # an unread step still writes the caches: let it finish
                read(launched)
