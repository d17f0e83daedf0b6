"""CUDA graphs of the decoder's steps: a step (a function of device tensors with no host synchronisation: the
verify step's forward, masks, sampling and truncation; a draft step) is captured once per key (batch-size
bucket, block width, which masks run) on static copies of its inputs, then replayed after its inputs are
copied in. Its outputs are the captured tensors, valid until the next replay of that key.

A step's side effects on the caches must replay too, so capture records them rather than running them; the
warm-up run that precedes capture (kernels' lazy initialisation, cuBLAS workspaces) does run them, and
`state` (the cache lengths) is restored after it, so that the call's own run is the replay. Writes past the
lengths that the warm-up leaves in the caches are overwritten by that replay or never read.

On the CPU (or with graphs off) run() just calls the step.
"""
import torch

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class StepGraphs:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.graphs = {}
        self.pool = None

    def bucket(self, batch: int, max_batch_size: int) -> int:
        """Rows to run: the batch itself eagerly; with graphs the smallest bucket that holds it, so that a few
        graphs cover every batch (rows past the batch are idle slots)."""
        if not self.enabled:
            return batch
        return min(next((b for b in BUCKETS if b >= batch), batch), max_batch_size)

    def clear(self) -> None:
        self.graphs.clear()

    def run(self, key, step, inputs: tuple, state=()):
        if not self.enabled:
            return step(*inputs)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self.capture(step, inputs, state)
        graph, static_inputs, outputs = entry
        for static, x in zip(static_inputs, inputs):
            if static is not None:
                static.copy_(x)
        graph.replay()
        return outputs

    def capture(self, step, inputs, state):
        static_inputs = tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in inputs)
        saved = [t.clone() for t in state]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step(*static_inputs)  # warm-up
        torch.cuda.current_stream().wait_stream(side)
        for t, s in zip(state, saved):
            t.copy_(s)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = step(*static_inputs)
        return graph, static_inputs, outputs
