"""The decode step of lesson 06's model, run by the Triton kernels of :mod:`~course.lessons.last_mile.kernels`.

:class:`TritonDecoder` reads **the same weight tensors** as the transformers model (with ``packed`` off: no copy, no
re-layout: q, k and v stay three matrices, gate and up two; a program picks the matrix its rows
belong to), keeps its KV cache as two static tensors ``[layers, kv_heads, max_len, head_dim]``
and its activations in static buffers, and launches ``2 + 5 * layers`` kernels per token
(:data:`KERNELS_PER_LAYER`): for TinyLlama's shape, 112.

``step(ids, position)`` has lesson 06's signature (``ids`` int64 ``[1, 1]``, ``position`` int64
``[1]``, device tensors, nothing read back to the host), so greedy decoding, the correctness check and
lesson 04's GraphCache take it as they take :class:`~course.lessons.real_model.decode.StaticDecoder`'s.
It returns the decoder's logits buffer ``[1, vocab]`` (float32), overwritten by the next step (as a CUDA
graph's outputs are): clone it to keep it. Batch 1 only: for batches, lesson 06's fused step.

Every size comes from the model's config (:func:`sizes`: hidden, MLP, vocabulary, heads, KV heads, head_dim),
so any Llama shape runs (tied embeddings too); what the kernels cannot compute (biases, another activation) is
refused with the reason. The last mile's options (:func:`config_for`: loads before the PDL wait, attention
reading the past first, split-K down_proj, packed weights, split-KV attention, :mod:`.split`) are fields of
:class:`Config`; with them off the weight tensors are the
model's own, with ``packed`` the decoder keeps packed copies.

``pdl=True`` launches every kernel with programmatic dependent launch (Hopper and later; not under
Triton's interpreter). :class:`Config` holds the launch shapes (rows per program, columns per chunk,
warps); :func:`default_config` picks them for a model's shape.
"""
from __future__ import annotations

import dataclasses

import torch

KERNELS_PER_LAYER = 5


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel's launch shape: output rows per program, columns per chunk, warps, chunks in flight (1 or 2).

    Every chunk in flight is loaded before the kernel's PDL wait (weights never change); a program whose
    rows fit in ``depth`` chunks has all its weights in registers before the kernel before it has finished.
    """

    rows: int
    block_k: int
    warps: int = 4
    depth: int = 1


@dataclasses.dataclass(frozen=True)
class Config:
    """Launch shapes of the five matrix kernels, and positions per attention iteration."""

    qkv: Launch  # rows: R, the rows of each RoPE half a program owns (2R rows in all)
    o: Launch
    gate_up: Launch  # rows of gate, and as many of up
    down: Launch
    lm_head: Launch
    block_t: int = 64
    packed: bool = False  # every product's weights repacked: a program's rows one run of 16-byte groups
    down_split: int = 1  # down_proj's columns split this many ways (split-K, :mod:`.split`); 1: not split
    kv_chunk: int = 0  # attention's positions split into pieces of this many (flash-decoding); 0: not split
    early: bool = False  # loads no earlier kernel writes before the PDL wait, the residual with the input, x read once
    ahead: bool = False  # attention reads the position and the past before the wait, the new row after it


def _p2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def default_config(hidden: int, intermediate: int, head_dim: int, vocab: int, interpret: bool = False,
                   **over) -> Config:
    """Launch shapes for a model's sizes; ``over`` replaces fields (e.g. ``down=Launch(4, 512)``).

    Compiled (a GPU): one to eight rows per program (hundreds of programs per product, every SM busy),
    chunks of up to 2048 columns. Interpreted: as many rows per program as fit (each program costs the
    interpreter the same Python work, whatever its size), so a tiny model's step takes a fraction of a second.
    """
    bk_h, bk_i = min(512, _p2(hidden)), min(512, _p2(intermediate))
    if interpret:
        cfg = Config(qkv=Launch(head_dim // 2, bk_h), o=Launch(min(256, _p2(hidden)), bk_h),
                     gate_up=Launch(min(256, _p2(intermediate)), bk_h), down=Launch(min(256, _p2(hidden)), bk_i),
                     lm_head=Launch(min(1024, _p2(vocab)), bk_h), block_t=64)
    else:
        # the H100's fastest whole step with PDL among the best of a sweep of each kernel alone: the
        # products over the hidden size take whole rows in one chunk (every weight loaded before the wait),
        # down_proj's rows (5632 wide) two chunks of 1024 in flight
        bk_h, bk_i = min(2048, _p2(hidden)), min(1024, _p2(intermediate))
        cfg = Config(qkv=Launch(1, bk_h), o=Launch(8, bk_h, 8), gate_up=Launch(2, bk_h), down=Launch(2, bk_i, 4, 2),
                     lm_head=Launch(2, min(1024, bk_h)))
    return dataclasses.replace(cfg, **over)


OPTIONS = ("early", "ahead", "split_k", "packed", "split_kv")  # the last mile's options, in the waterfall's order


def config_for(model, *, early: bool = False, ahead: bool = False, split_k: bool = False, packed: bool = False,
               split_kv: bool | str = False, interpret: bool | None = None, position: int | None = None,
               split_kv_from: int | None = None) -> Config:
    """:func:`default_config` for ``model``'s sizes, with the last mile's options (:data:`OPTIONS`) on or off.

    ``early``: every kernel's loads of what no earlier kernel writes (the position, cos/sin, the norms' weights of
    a row in one chunk) before its PDL wait, the residual loaded with the product's input, x read once per norm;
    ``ahead``: the unsplit attention reads the position and the past keys and values of its first two blocks before
    its wait (:func:`~.attention.attention_ahead`). Both keep every sum's order (compiled, logits move at rounding level);
    ``split_k``: down_proj's columns split so that a program holds at most ``depth`` chunks (all loaded before its
    PDL wait); ``packed``: every product's weights repacked (:func:`pack`); ``split_kv``: attention in pieces of 256
    positions (4 x ``block_t``); ``split_kv="auto"``: split only for a step serving ``position`` at
    or past ``split_kv_from``, the position from which a measurement found it pays
    (:func:`~course.lessons.last_mile.sweeps.split_kv_from`; None: it never did).
    """
    if split_kv == "auto":
        split_kv = position is not None and split_kv_from is not None and position >= split_kv_from
    elif not isinstance(split_kv, bool):
        raise ValueError(f"split_kv is True, False or 'auto', got {split_kv!r}")
    from course.core.triton_path import interpreting

    h, i, v, _, _, d = sizes(model.config)
    interpret = interpreting() if interpret is None else interpret
    cfg = default_config(h, i, d, v, interpret=interpret)
    over = {"early": early, "ahead": ahead}
    if split_k:
        chunks = -(-i // cfg.down.block_k)
        over["down_split"] = max(2, -(-chunks // cfg.down.depth))
    if packed:
        over["packed"] = True
    if split_kv:
        over["kv_chunk"] = 4 * cfg.block_t
    return dataclasses.replace(cfg, **over)


class TritonDecoder:
    """Batch-1 decode of a transformers Llama with five Triton kernels per layer (see the module doc)."""

    def __init__(self, model, max_len: int = 256, pdl: bool = False, config: Config | None = None):
        from course.core.triton_path import interpreting, missing_reason

        if missing_reason():
            raise ImportError(missing_reason())
        c = model.config
        if max_len < 2 or max_len > c.max_position_embeddings:
            raise ValueError(f"max_len must be in 2..{c.max_position_embeddings} (the model's positions), "
                             f"got {max_len}")
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        if self.dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"the Triton step runs bfloat16 or float32 models, got {self.dtype}")
        if pdl and (interpreting() or torch.cuda.get_device_capability(self.device) < (9, 0)):
            raise ValueError("pdl=True needs a Hopper (sm_90) or later GPU with compiled Triton kernels; "
                             "here use pdl=False")
        self.model, self.max_len, self.pdl = model, max_len, pdl
        self.H, self.I, self.V, self.NH, self.NKV, self.D = sizes(c)
        self.L, self.eps = c.num_hidden_layers, float(c.rms_norm_eps)
        self.config = cfg = config or default_config(self.H, self.I, self.D, self.V, interpret=interpreting())
        if (self.D // 2) % cfg.qkv.rows:
            raise ValueError(f"config.qkv.rows ({cfg.qkv.rows}) must divide head_dim / 2 ({self.D // 2})")
        self.vec = 16 // torch.tensor([], dtype=self.dtype).element_size() if cfg.packed else 0
        if cfg.packed and (self.H % self.vec or self.I % self.vec):
            raise ValueError(f"packed weights need hidden ({self.H}) and intermediate ({self.I}) sizes that are "
                             f"multiples of {self.vec} (16 bytes); use packed=False")
        if cfg.down_split < 1 or cfg.kv_chunk < 0 or (cfg.kv_chunk and cfg.kv_chunk % cfg.block_t):
            raise ValueError(f"down_split must be >= 1 and kv_chunk 0 or a multiple of block_t ({cfg.block_t}), got "
                             f"{cfg.down_split} and {cfg.kv_chunk}")
        m = model.model
        self.emb, self.final_norm, self.lm = m.embed_tokens.weight, m.norm.weight, model.lm_head.weight
        self.layers = [(l.input_layernorm.weight, l.self_attn.q_proj.weight, l.self_attn.k_proj.weight,
                        l.self_attn.v_proj.weight, l.self_attn.o_proj.weight, l.post_attention_layernorm.weight,
                        l.mlp.gate_proj.weight, l.mlp.up_proj.weight, l.mlp.down_proj.weight) for l in m.layers]
        if any(not w.is_contiguous() for ws in self.layers for w in ws):
            raise ValueError("the Triton step needs contiguous weights (a model as transformers builds it)")
        if cfg.packed:
            self.layers, self.lm = self._packed(cfg)
        dev, dt = self.device, self.dtype
        with torch.no_grad():
            pos = torch.arange(max_len, device=dev).view(1, -1)
            cos, sin = m.rotary_emb(torch.zeros(1, device=dev, dtype=dt), pos)  # transformers' own values
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()
        self.x = torch.zeros(self.H, device=dev, dtype=dt)  # the residual stream
        self.q = torch.zeros(self.NH * self.D, device=dev, dtype=dt)
        self.attn = torch.zeros(self.NH * self.D, device=dev, dtype=dt)
        self.act = torch.zeros(self.I, device=dev, dtype=dt)
        self.logits = torch.zeros(1, self.V, device=dev, dtype=torch.float32)
        self.k_cache = torch.zeros(self.L, self.NKV, max_len, self.D, device=dev, dtype=dt)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.scale = self.D ** -0.5
        # scratch of the split kernels: float32 parts, and one ticket counter per output (zero between calls)
        self.down_part = torch.zeros(cfg.down_split, self.H, device=dev, dtype=torch.float32)
        self.down_count = torch.zeros(-(-self.H // cfg.down.rows), device=dev, dtype=torch.int32)
        self.kv_pieces = -(-max_len // cfg.kv_chunk) if cfg.kv_chunk else 1
        self.attn_part = torch.zeros(self.NH, self.kv_pieces, self.D + 2, device=dev, dtype=torch.float32)
        self.attn_count = torch.zeros(self.NH, device=dev, dtype=torch.int32)
        from course.lessons.last_mile import kernels, split

        self._kernels, self._split = kernels, split  # imported here: Triton decides interpreted or compiled as it loads

    def _packed(self, cfg: Config) -> tuple:
        """Every product's weights as :func:`pack` lays them out for its kernel's rows per program (copies)."""
        v, half = self.vec, self.D // 2
        out = []
        for n1, wq, wk, wv, wo, n2, wg, wu, wd in self.layers:
            heads = torch.cat([wq, wk, wv]).view(-1, self.D, self.H)  # q, k, v heads: each program's rows, both halves
            lo = pack(heads[:, :half].reshape(-1, self.H), cfg.qkv.rows, v)
            hi = pack(heads[:, half:].reshape(-1, self.H), cfg.qkv.rows, v)
            out.append((n1, lo, hi, lo, pack(wo, cfg.o.rows, v), n2, pack(wg, cfg.gate_up.rows, v),
                        pack(wu, cfg.gate_up.rows, v), pack(wd, cfg.down.rows, v)))
        return out, pack(self.lm, cfg.lm_head.rows, v)

    @property
    def kernels_per_token(self) -> int:
        """Kernels one step launches: the embedding, five per layer, the final norm with lm_head."""
        return 2 + KERNELS_PER_LAYER * self.L

    def _go(self, kernel, grid, *args, warps: int = 4, **meta):
        extra = {"launch_pdl": True} if self.pdl else {}
        kernel[grid if isinstance(grid, tuple) else (grid,)](*args, PDL=self.pdl, num_warps=warps, **meta, **extra)

    # one method per kernel, so a benchmark can launch any one of them alone
    def embed(self, ids) -> None:
        """Kernel 0: the token's embedding row into the residual stream."""
        blk = min(1024, _p2(self.H))
        self._go(self._kernels.embed, -(-self.H // blk), ids, self.emb, self.x, self.H, BLOCK=blk)

    def qkv(self, layer: int, position) -> None:
        """Kernel 1 of ``layer``: RMSNorm, q/k/v, RoPE, the KV-cache write at ``position``."""
        n1, wq, wk, wv = self.layers[layer][:4]
        c, r = self.config.qkv, self.config.qkv.rows
        self._go(self._kernels.norm_qkv_rope, (self.NH + 2 * self.NKV) * (self.D // 2 // r), self.x, n1, wq, wk, wv,
                 self.cos, self.sin, position, self.q, self.k_cache[layer], self.v_cache[layer], self.H, self.eps,
                 self.max_len, NH=self.NH, NKV=self.NKV, D=self.D, R=r, BLOCK_K=c.block_k, warps=c.warps,
                 DEPTH=c.depth, VEC=self.vec, EARLY=self.config.early)

    def attend(self, layer: int, position) -> None:
        """Kernel 2 of ``layer``: attention over positions 0..position (split into pieces if ``kv_chunk``)."""
        cfg = self.config
        if cfg.kv_chunk:
            self._go(self._split.attention_split, (self.NH, self.kv_pieces), self.q, self.k_cache[layer],
                     self.v_cache[layer], position, self.attn, self.attn_part, self.attn_count, self.max_len,
                     self.scale, NH=self.NH, NKV=self.NKV, D=self.D, BLOCK_T=cfg.block_t, CHUNK=cfg.kv_chunk,
                     SPLITS=self.kv_pieces)
            return
        self._go(self._kernels.attention, self.NH, self.q, self.k_cache[layer], self.v_cache[layer], position,
                 self.attn, self.max_len, self.scale, NH=self.NH, NKV=self.NKV, D=self.D, BLOCK_T=cfg.block_t,
                 AHEAD=cfg.ahead)

    def o_proj(self, layer: int) -> None:
        """Kernel 3 of ``layer``: o_proj, added to the residual stream."""
        c = self.config.o
        self._go(self._kernels.proj_residual, -(-self.H // c.rows), self.attn, self.layers[layer][4], self.x, self.H,
                 self.NH * self.D, BLOCK_N=c.rows, BLOCK_K=c.block_k, warps=c.warps, DEPTH=c.depth, VEC=self.vec,
                 EARLY=self.config.early)

    def gate_up(self, layer: int) -> None:
        """Kernel 4 of ``layer``: RMSNorm, gate and up, SiLU(gate) * up."""
        n2, wg, wu = self.layers[layer][5:8]
        c = self.config.gate_up
        self._go(self._kernels.norm_gate_up, -(-self.I // c.rows), self.x, n2, wg, wu, self.act, self.I, self.H,
                 self.eps, BLOCK_N=c.rows, BLOCK_K=c.block_k, warps=c.warps, DEPTH=c.depth, VEC=self.vec,
                 EARLY=self.config.early)

    def down(self, layer: int) -> None:
        """Kernel 5 of ``layer``: down_proj, added to the residual stream (split-K if ``down_split`` > 1)."""
        c, n = self.config.down, self.config.down_split
        blocks = -(-self.H // c.rows)
        if n > 1:
            self._go(self._split.proj_residual_split, (blocks, n), self.act, self.layers[layer][8], self.x,
                     self.down_part, self.down_count, self.H, self.I, BLOCK_N=c.rows, BLOCK_K=c.block_k,
                     warps=c.warps, DEPTH=c.depth, VEC=self.vec, SPLIT=n)
            return
        self._go(self._kernels.proj_residual, blocks, self.act, self.layers[layer][8], self.x, self.H,
                 self.I, BLOCK_N=c.rows, BLOCK_K=c.block_k, warps=c.warps, DEPTH=c.depth, VEC=self.vec,
                 EARLY=self.config.early)

    def head(self) -> None:
        """The last kernel: final RMSNorm and lm_head into the logits buffer."""
        c = self.config.lm_head
        self._go(self._kernels.norm_lm_head, -(-self.V // c.rows), self.x, self.final_norm, self.lm, self.logits,
                 self.V, self.H, self.eps, BLOCK_N=c.rows, BLOCK_K=c.block_k, warps=c.warps, DEPTH=c.depth,
                 VEC=self.vec, EARLY=self.config.early)

    def step(self, ids, position):
        """Logits ``[1, vocab]`` (float32, the decoder's buffer) after ``ids`` ``[1, 1]`` at ``position`` ``[1]``.

        Writes each layer's K/V at ``position`` (which must be below ``max_len``) and attends over 0..position.
        """
        if ids.dim() != 2 or ids.shape != (1, 1) or position.shape != (1,):
            raise ValueError(f"the Triton step decodes one sequence: ids [1, 1] and position [1] (device tensors), "
                             f"got ids {tuple(ids.shape)} and position {tuple(position.shape)}; for batches use "
                             "lesson 06's fused step")
        self.embed(ids)
        for layer in range(self.L):
            self.qkv(layer, position)
            self.attend(layer, position)
            self.o_proj(layer)
            self.gate_up(layer)
            self.down(layer)
        self.head()
        return self.logits

    def reset(self) -> None:
        """Zero the KV cache (not needed between sequences: a step writes its position before it reads it)."""
        self.k_cache.zero_()
        self.v_cache.zero_()


def sizes(config) -> tuple:
    """``(hidden, intermediate, vocab, heads, kv_heads, head_dim)`` of a Llama config; what the kernels cannot run
    (biases, another activation, a head width that is not a power of two, heads not in KV groups) is refused."""
    c = config
    h, nh, nkv = c.hidden_size, c.num_attention_heads, c.num_key_value_heads
    d = getattr(c, "head_dim", None) or h // nh
    if d % 2 or d & (d - 1):
        raise ValueError(f"the Triton step needs a head_dim that is a power of two, got {d}")
    if nh % nkv:
        raise ValueError(f"num_attention_heads ({nh}) must be a multiple of num_key_value_heads ({nkv})")
    if getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False):
        raise ValueError("the Triton step has no bias terms: the model's config sets attention_bias or mlp_bias")
    if getattr(c, "hidden_act", "silu") != "silu":
        raise ValueError(f"the Triton step computes SiLU(gate) * up; the model uses {c.hidden_act!r}")
    return h, c.intermediate_size, c.vocab_size, nh, nkv, d


def pack(w, rows: int, vec: int):
    """``w [N, K]`` laid out for programs of ``rows`` rows: ``[N / rows, K / vec, rows, vec]``, contiguous.

    A program's block is one run of memory in the order its loads walk it (for each group of ``vec`` columns,
    16 bytes, every row of the program), rows past ``N`` zero.
    """
    n, k = w.shape
    if k % vec:
        raise ValueError(f"pack: K ({k}) must be a multiple of vec ({vec})")
    pad = (-n) % rows
    if pad:
        w = torch.cat([w, w.new_zeros(pad, k)])
    return w.view(-1, rows, k // vec, vec).permute(0, 2, 1, 3).contiguous()


def captured(decoder: TritonDecoder):
    """``decoder.step`` in lesson 04's GraphCache (one bucket: batch 1), as lesson 06 wraps its steps.

    On the GPU path a CUDA graph holds the step's kernels (with PDL edges when ``decoder.pdl``); on the
    simulator path, the recording backend.
    """
    from course.lessons.graph_cache.cache import GraphCache
    from course.lessons.real_model.decode import model_backend

    if not isinstance(decoder, TritonDecoder):
        raise TypeError(f"captured wraps a TritonDecoder, got {type(decoder).__name__}")
    return GraphCache(decoder.step, buckets=[1], batched=(0,), pad_value=(0, 0), backend=model_backend())


def graphed(decoder: TritonDecoder, ids, position):
    """``decoder.step`` captured in one CUDA graph by hand (GPU): a step that copies its inputs into the graph's
    static ``ids`` and ``position`` and replays, returning the decoder's logits buffer (no copy of it).

    What :func:`captured` does less the cache's bookkeeping (looking the key up, copying the outputs out):
    the waterfall times both, so the cost of that bookkeeping is a row of its own.
    """
    import torch

    from course.core.capture import graph as capture_graph, warm_up

    ids_s, pos_s = ids.clone(), position.clone()
    warm_up(lambda: decoder.step(ids_s, pos_s), 2)
    g = torch.cuda.CUDAGraph()
    with capture_graph(g):
        decoder.step(ids_s, pos_s)

    def step(ids, position):
        """Copy the inputs in, replay the graph, return the logits buffer (overwritten by the next replay)."""
        ids_s.copy_(ids)
        pos_s.copy_(position)
        g.replay()
        return decoder.logits

    step.graph = g  # keeps the graph alive as long as the step
    return step
