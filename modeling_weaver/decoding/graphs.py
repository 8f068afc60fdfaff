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


class PipelinedSteps:
    """Steps whose inputs the previous step left on the device, one CUDA graph each, launched one ahead of the host.

    A subclass gives ``_step()`` (returns a small ``[summary_size]`` long tensor: what the host reads), ``_state()``
    (what a step advances in place) and ``_parse(list)`` (the host side of a summary). :meth:`run` yields the parsed
    summaries; while the host reads step k, step k+1 already runs.
    """

    def __init__(self, device: torch.device, summary_size: int, capture: bool):
        self.capture = capture
        self._graph: tuple | None = None
        # Two host slots for summaries, one being read, one being filled, each with the event that says it is full
        # (a slot is launched again only after it was read).
        cuda = device.type == "cuda"
        self._host = [torch.zeros(summary_size, dtype=torch.long, pin_memory=cuda) for _ in range(2)]
        self._events = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self._slot = 0

    def _launch(self) -> tuple[torch.Tensor, object]:
        """Start one step; returns ``(host slot, event)``: the slot holds its summary once the event has completed
        (no event: it holds it already)."""
        if not self.capture:
            return self._step(), None
        if self._graph is None:  # a warm-up step advances the state: restored
            self._graph = capture_graph(self._step, warmup=1, restore=self._state())
        self._graph[0].replay()
        host, event = self._host[self._slot], self._events[self._slot]
        self._slot = 1 - self._slot
        host.copy_(self._graph[1], non_blocking=True)  # ordered before the next replay overwrites the summary
        if event is not None:
            event.record()
        return host, event

    def _read(self, launched):
        host, event = launched
        if event is not None:
            event.synchronize()
        return self._parse(host.tolist())

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
            for _, event in in_flight:  # an unread step still writes the caches: let it finish
                if event is not None:
                    event.synchronize()
