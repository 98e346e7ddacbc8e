"""The persistent step: :class:`PersistentDecoder` launches :func:`~.persistent.persistent_step`
once per token.

It is a :class:`~.decoder.TritonDecoder` (the same weights, static buffers and KV cache, the same
``step(ids, position)`` returning the logits buffer) whose step is one launch of ``programs``
programs instead of ``2 + 5 * layers`` kernels. :func:`persistent_config` picks each stage's tiles
for one program per SM (bigger tiles than the five kernels': a program walks a stage's tiles).

**Resident programs.** A grid barrier opens only when every program runs at once:
:func:`resident_per_sm` reads the registers and shared memory a compiled program needs and what an
SM has, and the decoder refuses more programs than SMs x that. The barrier's spin limit turns a
barrier that never opens into an error (:meth:`PersistentDecoder.check`), not a hung GPU.

Under Triton's interpreter (a laptop) the step runs under :mod:`.coop` (a few programs as
co-operating threads): the same kernel, the same barriers; ``watch=True`` there checks the order of
every access to the step's activations (:meth:`PersistentDecoder.last_trace`).
"""
from __future__ import annotations

import dataclasses

import torch

from course.core.triton_path import interpreting
from course.lessons.last_mile import coop
from course.lessons.last_mile.decoder import Config, Launch, TritonDecoder, _p2, sizes
from course.lessons.last_mile.persistent_tuning import shapes_for, tuned as recorded

SPIN_GPU = 1 << 21  # spin turns before a program gives up (an atomic round trip each: ~a second)
SPIN_INTERPRETED = 2000  # a turn is a switch between threads there: a working barrier needs a few
PROGRAMS_INTERPRETED = 3


def persistent_config(hidden: int, intermediate: int, head_dim: int, vocab: int,
                      interpret: bool = False, **over) -> Config:
    """Tiles per stage for the persistent step (``over`` replaces fields, as in
    :func:`~.decoder.default_config`).

    Compiled: 16 rows per tile for o, down and lm_head, 8 of gate and 8 of up, two chunks of 512
    columns in flight (each program's first 2 x 16 KB of a stage loaded before the barrier ahead of
    it); q/k/v 2 rows per RoPE half, whole rows up to 1024 columns. Interpreted: tiles small enough
    that each of the few programs walks several.
    """
    if interpret:
        bk_h, bk_i = min(64, _p2(hidden)), min(64, _p2(intermediate))
        cfg = Config(qkv=Launch(max(1, head_dim // 8), bk_h), o=Launch(16, bk_h, depth=2),
                     gate_up=Launch(16, bk_h), down=Launch(16, bk_i, depth=2),
                     lm_head=Launch(64, bk_h, depth=2), block_t=16)
    else:
        bk = min(512, _p2(hidden))
        cfg = Config(qkv=Launch(2, min(1024, _p2(hidden)), 8, 1), o=Launch(16, bk, 8, 2),
                     gate_up=Launch(8, bk, 8, 2), lm_head=Launch(16, bk, 8, 2),
                     down=Launch(16, min(512, _p2(intermediate)), 8, 2))
    return dataclasses.replace(cfg, **over)


def resident_per_sm(n_regs: int, shared: int, warps: int, props: dict) -> int:
    """Programs of ``warps`` warps one SM holds at once, for ``n_regs`` registers per thread and
    ``shared`` bytes per program, on a GPU of ``props`` (``max_num_regs``, ``max_shared_mem``,
    ``max_threads``, per SM). Registers are given out per warp in blocks of 256."""
    threads = 32 * warps
    per_warp = -(-max(1, n_regs) * 32 // 256) * 256
    by_regs = props.get("max_num_regs", 65536) // (per_warp * warps)
    by_threads = props.get("max_threads", 2048) // threads
    by_shared = props.get("max_shared_mem", 232448) // shared if shared else by_threads
    return max(0, min(by_regs, by_threads, by_shared, 32))


class PersistentDecoder(TritonDecoder):
    """Batch-1 decode of a transformers Llama in one persistent Triton kernel per token."""

    def __init__(self, model, max_len: int = 256, programs: int | None = None,
                 config: Config | None = None, warps: int = 8, spin: int | None = None,
                 watch: bool = False, ahead: bool = True, programs_per_sm: int = 1,
                 tuned: bool = True):
        from course.lessons.last_mile import persistent  # Triton: after the interpreter decision

        h, i, v, _, _, d = sizes(model.config)
        interp = interpreting()
        cfg = config or persistent_config(h, i, d, v, interpret=interp)
        self.tuned = None
        if tuned and config is None and not interp:  # this GPU's recorded search, where it chose
            found = recorded(torch.cuda.get_device_name(model.device))
            if found:
                warps, programs_per_sm, stages = found
                cfg = shapes_for(cfg, stages, model.config)
                self.tuned = found
        if cfg.packed or cfg.down_split > 1 or cfg.kv_chunk:
            raise ValueError("the persistent step reads the model's own weights with whole rows "
                             "per tile: packed, down_split and kv_chunk must be off in its config")
        super().__init__(model, max_len, pdl=False, config=cfg)
        self._persistent, self.programs_per_sm = persistent, programs_per_sm
        self.warps, self.watch, self.trace, self.ahead = warps, watch, None, ahead
        self.spin = spin or (SPIN_INTERPRETED if interp else SPIN_GPU)
        self.bar = torch.zeros(4, device=self.device, dtype=torch.int32)  # count, generation, flag
        es = self.x.element_size()
        self.base = self.layers[0][1]
        offs = [(w.data_ptr() - self.base.data_ptr()) for ws in self.layers for w in ws]
        if any(o % es for o in offs):
            raise ValueError("the layers' weights must be whole elements apart in memory")
        self.align = 16 // es if all(o % 16 == 0 for o in offs) else 1
        self.offsets = torch.tensor([o // es for o in offs], device=self.device, dtype=torch.int64)
        assert len(self.layers[0]) == persistent.N_WEIGHTS
        self.per_sm, self.interpreted = None, interp
        if interp:
            self.programs = self.sms = programs or PROGRAMS_INTERPRETED
        else:
            self.programs = self._resident(programs)

    def _args(self, ids, position) -> tuple:
        return (ids, position, self.emb, self.x, self.q, self.attn, self.act, self.logits, self.cos,
                self.sin, self.k_cache, self.v_cache, self.final_norm, self.lm, self.base,
                self.offsets, self.bar, self.spin, self.eps, self.max_len, self.scale)

    def _meta(self) -> dict:
        c = self.config
        m = dict(H=self.H, I=self.I, V=self.V, NH=self.NH, NKV=self.NKV, D=self.D, L=self.L,
                 ALIGN=self.align, EBLOCK=min(1024, _p2(self.H)), BLOCK_T=c.block_t,
                 QR=c.qkv.rows, QBK=c.qkv.block_k, QDEPTH=c.qkv.depth, AHEAD=self.ahead)
        for k, ln in (("O", c.o), ("G", c.gate_up), ("D", c.down), ("L", c.lm_head)):
            m.update({f"{k}BN": ln.rows, f"{k}BK": ln.block_k, f"{k}DEPTH": ln.depth})
        return m

    def _resident(self, programs: int | None) -> int:
        """Programs for the grid (GPU): one per SM unless asked, never more than stay resident."""
        from triton.runtime import driver

        ids = torch.zeros(1, 1, device=self.device, dtype=torch.int64)
        pos = torch.zeros(1, device=self.device, dtype=torch.int64)
        k = self._persistent.persistent_step.warmup(*self._args(ids, pos), **self._meta(),
                                                    num_warps=self.warps, grid=(1,))
        k._init_handles()
        props = driver.active.utils.get_device_properties(self.device.index or 0)
        self.sms = props["multiprocessor_count"]
        self.n_regs, self.n_spills, self.shared = k.n_regs, k.n_spills, k.metadata.shared
        self.per_sm = resident_per_sm(self.n_regs, self.shared, self.warps, props)
        most = self.sms * self.per_sm
        if most < 1:
            raise ValueError(f"a program of the persistent step ({self.n_regs} registers x "
                             f"{32 * self.warps} threads, {self.shared} B shared) does not fit on "
                             "an SM: use fewer warps or rows")
        n = programs or self.sms * self.programs_per_sm
        if n > most:
            raise ValueError(f"{n} programs cannot all be resident ({self.sms} SMs x {self.per_sm} "
                             f"per SM = {most}): a grid barrier would wait forever; use at most "
                             "that many")
        return n

    @property
    def kernels_per_token(self) -> int:
        """Launches per step: one."""
        return 1

    def step(self, ids, position):
        """Logits ``[1, vocab]`` (float32, the decoder's buffer) after ``ids`` ``[1, 1]`` at
        ``position`` ``[1]``, in one launch. Nothing is read back: :meth:`check` says whether a
        barrier timed out."""
        if ids.dim() != 2 or ids.shape != (1, 1) or position.shape != (1,):
            raise ValueError(f"the persistent step decodes one sequence: ids [1, 1] and position "
                             f"[1] (device tensors), got ids {tuple(ids.shape)} and position "
                             f"{tuple(position.shape)}")
        kernel, args = self._persistent.persistent_step, self._args(ids, position)
        meta = self._meta()
        if self.interpreted:  # the interpreter: co-operating programs
            watch = {"x": self.x, "q": self.q, "attn": self.attn, "act": self.act,
                     "logits": self.logits, "k_cache": self.k_cache,
                     "v_cache": self.v_cache} if self.watch else None
            self.trace = coop.run(kernel, self.programs, *args, watch=watch, **meta)
            if self.trace.deadlock:  # ended by coop before the spin limit: the kernel's own verdict
                self.bar[2] = 1
        else:
            kernel[(self.programs,)](*args, **meta, num_warps=self.warps)
        return self.logits

    def check(self) -> None:
        """Raise if a grid barrier of any step so far timed out (reads the error flag: a sync)."""
        if int(self.bar[2]):
            raise RuntimeError(f"a grid barrier of the persistent step never opened (its "
                               f"{self.spin} spins ran out): were all {self.programs} programs "
                               "resident? The logits are not valid.")

    def last_trace(self):
        """The :class:`~.coop.Trace` of the last step (interpreter with ``watch=True``)."""
        return self.trace
