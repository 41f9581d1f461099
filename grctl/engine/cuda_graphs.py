"""DecodeGraphs: a decode step's dense work replayed from CUDA graphs, one set per batch bucket.

Decode attention reads each request's own context KV (a different length per request, changing
every step), so it stays eager; everything around it is captured. Per bucket of `rows` beams the
step is L + 1 graphs over static buffers: [rope + embed + pre-attention 0], [post-attention i-1 +
pre-attention i] for each next layer, [post-attention L-1 + norm + lm_head]; eager
attention runs between replays, reading q/k/v from and writing its output to the static buffers.
A batch pads up to the smallest bucket that holds it (padding rows compute garbage that is never
read); a batch larger than every bucket runs eagerly. Weights are only ever written in place, so a
graph replayed after a weight update reads the new values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import partial

import torch

from grctl.model.qwen3 import Qwen3ForCausalLM
from grctl.model.rope import rope_cos_sin

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# attend(layer, q [rows, H, D], k [rows, KV, D], v [rows, KV, D], out [bucket, H * D])
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def capture_cuda_graph(piece: Callable[[], None], pool) -> torch.cuda.CUDAGraph:
    # The caller holds torch.cuda.device(model's device): the stream and the graph live there.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture (lazy init, kernel selection)
        piece()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        piece()
    return graph


class EagerPiece:
    """Stands in for a captured graph where there is no CUDA (CPU tests): replay reruns it."""

    def __init__(self, piece: Callable[[], None], pool=None):
        self.replay = piece


BUFFERS = ("ids", "positions", "cos", "sin", "h", "q", "k", "v", "attn", "logits")


def static_buffers(model: Qwen3ForCausalLM, rows: int, device: torch.device) -> dict:
    """The graphs' inputs, outputs and intermediates for `rows` rows, allocated once at the
    largest bucket: a smaller bucket's graphs read and write the first rows of the same
    tensors (only one bucket replays at a time)."""
    cfg, dtype = model.config, model.embed_tokens.weight.dtype

    def empty(*shape, dt=dtype):
        return torch.zeros(shape, dtype=dt, device=device)

    return {
        "ids": empty(rows, dt=torch.int64),
        "positions": empty(rows, dt=torch.int64),
        "cos": empty(rows, cfg.head_dim),
        "sin": empty(rows, cfg.head_dim),
        "h": empty(rows, cfg.hidden_size),  # the residual stream
        "q": empty(rows, cfg.num_attention_heads, cfg.head_dim),
        "k": empty(rows, cfg.num_kv_heads, cfg.head_dim),
        "v": empty(rows, cfg.num_kv_heads, cfg.head_dim),
        "attn": empty(rows, cfg.q_size),
        "logits": empty(rows, cfg.vocab_size, dt=torch.float32),
    }


class _Bucket:
    def __init__(self, model: Qwen3ForCausalLM, rows: int, buffers: dict, pool, capture):
        self.model, self.rows = model, rows
        for name in BUFFERS:  # leading rows of the shared buffers: contiguous views
            setattr(self, name, buffers[name][:rows])
        num_layers = model.config.num_layers
        pieces = [lambda: self._first()]
        pieces += [lambda i=i: self._middle(i) for i in range(1, num_layers)]
        pieces.append(lambda: self._last())
        self.graphs = [capture(piece, pool) for piece in pieces]

    def _pre(self, i: int) -> None:
        q, k, v = self.model.layers[i].pre_attention(self.h, self.cos, self.sin)
        self.q.copy_(q)
        self.k.copy_(k)
        self.v.copy_(v)

    def _post(self, i: int) -> None:
        self.h.copy_(self.model.layers[i].post_attention(self.h, self.attn))

    def _first(self) -> None:
        cos, sin = rope_cos_sin(self.positions, self.model.config)
        self.cos.copy_(cos)
        self.sin.copy_(sin)
        self.h.copy_(self.model.embed_tokens(self.ids))
        self._pre(0)

    def _middle(self, i: int) -> None:
        self._post(i - 1)
        self._pre(i)

    def _last(self) -> None:
        self._post(self.model.config.num_layers - 1)
        self.logits.copy_(self.model.logits(self.h))

    def run(self, ids: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        n = ids.shape[0]
        self.ids[:n].copy_(ids)
        self.ids[n:].zero_()
        self.positions[:n].copy_(positions)
        self.positions[n:].zero_()
        for i, graph in enumerate(self.graphs[:-1]):
            graph.replay()
            attend(i, self.q[:n], self.k[:n], self.v[:n], self.attn)
        self.graphs[-1].replay()
        return self.logits[:n].clone()


class DecodeGraphs:
    def __init__(
        self,
        model: Qwen3ForCausalLM,
        device: torch.device,
        buckets: tuple[int, ...] = DEFAULT_BUCKETS,
        capture: Callable = capture_cuda_graph,
    ):
        is_cuda = device.type == "cuda"
        self.buckets: dict[int, _Bucket] = {}
        self.num_replays = 0
        self._capture = capture
        # Capture on the model's device whatever this thread's current device is (a capture
        # stream on cuda:0 would record nothing of a model on cuda:1).
        on_device = torch.cuda.device(device) if is_cuda else contextlib.nullcontext()
        with on_device, torch.inference_mode():
            pool = torch.cuda.graph_pool_handle() if is_cuda else None
            self.buffers = static_buffers(model, max(buckets), device)
            for rows in sorted(buckets, reverse=True):  # largest first: smaller ones reuse pool
                self.buckets[rows] = _Bucket(model, rows, self.buffers, pool, capture)
        if is_cuda:
            torch.cuda.synchronize(device)
        self._sizes = sorted(self.buckets)

    def factory(self) -> Callable[[Qwen3ForCausalLM, torch.device], DecodeGraphs]:
        """Captures the same buckets again (after the weights' storage moved), holding no
        reference to these graphs or their buffers."""
        return partial(DecodeGraphs, buckets=tuple(self._sizes), capture=self._capture)

    def fits(self, rows: int) -> bool:
        return rows <= self._sizes[-1]

    def run(self, ids: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        rows = next(s for s in self._sizes if s >= ids.shape[0])
        self.num_replays += 1
        return self.buckets[rows].run(ids, positions, attend)

    def stats(self) -> dict:
        return {"enabled": True, "buckets": self._sizes, "replays": self.num_replays}
