"""Our own CPU kernels (csrc/cpu_kernels.c) for the decode hot path, loaded through ctypes.

The C file is compiled once per machine with the system C compiler (``-march=native``) into
``$TOKENLINE_HOME/kernels/`` and reused; it links the libgomp torch already loaded, so its threads
are torch's. Without a compiler, or with ``TOKENLINE_CPU_KERNELS=0``, ``load()`` returns None and
the model keeps its pure-torch path: the kernels are a speed-up, never a requirement.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenline.model.packed_weight import BlockedLayout
from tokenline.model.panel_weight import PANEL
from tokenline.model.quantization import BLOCK, CODE_BLOCK_BYTES
from tokenline.store.model_store import tokenline_home

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.c"
CFLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_P = ctypes.c_void_p


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes in bfloat16 natively (AVX-512 BF16 or AMX). Elsewhere (an AVX2-only
    EPYC, say) oneDNN refuses to pack bf16 weights and every bf16 op is emulated."""
    return torch.cpu._is_avx512_bf16_supported() or cpu_has_amx()


@functools.cache
def cpu_has_amx() -> bool:
    """Whether oneDNN multiplies bfloat16 on AMX tiles here (then it beats our streaming kernel from
    a few rows up; see layers.small_batch_rows)."""
    return torch.cpu._is_amx_tile_supported()
_I = ctypes.c_int64


def _cpu_signature() -> str:
    """What -march=native compiles for: a library built on one CPU must not load on another."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def build(compiler: str | None = None, source: Path = SOURCE, extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile the kernels unless this exact source was already built for this CPU; return the .so.
    ``source``: another revision of the C file (benchmarks compare against an older kernel);
    ``extra_flags``: e.g. ``-mno-avx512bf16``, to build and test the portable paths on this CPU."""
    compiler = compiler or os.environ.get("CC", "cc")
    key = hashlib.sha256(
        source.read_bytes()
        + " ".join((compiler, *CFLAGS, *extra_flags, torch.__version__, _cpu_signature())).encode()
    ).hexdigest()[:16]
    out_dir = tokenline_home() / "kernels"
    target = out_dir / f"cpu_kernels-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    # Link torch's own libgomp (same soname, already loaded), not a second OpenMP runtime.
    torch_lib = Path(torch.__file__).parent / "lib"
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        partial = Path(tmp) / target.name
        subprocess.run(
            [compiler, *CFLAGS, *extra_flags, str(source), "-o", str(partial), f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}", "-lm"],
            check=True,
            capture_output=True,
            text=True,
        )
        os.replace(partial, target)  # atomic: concurrent builders never load a half-written file
    log.info("built CPU kernels: %s", target)
    return target


def build_revision(rev: str) -> tuple[Path, str]:
    """The kernels' C source at git revision ``rev`` of this checkout, built (benchmarks time an older
    kernel beside this one): the library and that source. Raises OSError or CalledProcessError
    without git, the revision or a compiler."""
    root = SOURCE.parents[3]
    source = subprocess.run(["git", "-C", str(root), "show", f"{rev}:{SOURCE.relative_to(root).as_posix()}"],
                            check=True, capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / SOURCE.name
        path.write_text(source)
        return build(source=path), source


class CpuKernels:
    """Typed wrappers over the compiled library; inputs are checked, outputs freshly allocated."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        lib.tl_has_avx512bf16.restype = ctypes.c_int
        lib.tl_linear_bf16.argtypes = [_P, _P, _P, _I, _I, _I]
        lib.tl_linear_bf16.restype = None
        lib.tl_linear_bf16_blocked.argtypes = [_P, _P, _P, _I, _I, _I, _I, _I]
        lib.tl_linear_bf16_blocked.restype = None
        lib.tl_decode_attention.argtypes = [ctypes.c_int, ctypes.c_int, _P, _I, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _I,
                                            ctypes.c_float, _I]
        lib.tl_decode_attention.restype = None
        lib.tl_rms_norm_bf16.argtypes = [_P, _P, _P, _I, _I, ctypes.c_float]
        lib.tl_rms_norm_bf16.restype = None
        lib.tl_rotary_bf16.argtypes = [_P, _I, _P, _P, _I, _I, _I]
        lib.tl_rotary_bf16.restype = None
        lib.tl_linear_panels_f32.argtypes = [_P, _P, _P, _I, _I, _I]
        lib.tl_linear_panels_f32.restype = None
        lib.tl_linear_q.argtypes = [ctypes.c_int, _P, _P, _P, _I, _I, _I]
        lib.tl_linear_q.restype = None
        lib.tl_linear_q_bf16.argtypes = [ctypes.c_int, _P, _P, _P, _I, _I, _I]
        lib.tl_linear_q_bf16.restype = None
        lib.tl_linear_qp.argtypes = [ctypes.c_int, ctypes.c_int, _P, _P, _P, _I, _I, _I]
        lib.tl_linear_qp.restype = None
        lib.tl_has_avx512vnni.restype = ctypes.c_int
        lib.tl_dequantize_q.argtypes = [ctypes.c_int, _P, _P, _I, _I]
        lib.tl_dequantize_q.restype = None
        lib.tl_decode_layer_f32.argtypes = [ctypes.c_int, ctypes.c_int, _P, _I, _I, ctypes.c_float, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _P, _P,
                                            _P, _P, _P, _P, _I, _P, _I, _I, ctypes.c_float, _P, _P]
        lib.tl_decode_layer_f32.restype = None
        lib.tl_decode_layer_bf16.argtypes = [_P, _I, _I, ctypes.c_float, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _P, _P, _P,
                                             _P, _P, _P, _I, _P, _I, _I, ctypes.c_float, _P, _P]
        lib.tl_decode_layer_bf16.restype = None
        lib.tl_prefill_attention_bf16.argtypes = [_P, _I, _P, _P, _I, _I, _I, _I, _I, _P, _P, _P, _P, _I, ctypes.c_float,
                                                  _I, _P]
        lib.tl_prefill_attention_bf16.restype = ctypes.c_int
        lib.tl_silu_mul_bf16.argtypes = [_P, _P, _I, _I]
        lib.tl_silu_mul_bf16.restype = None
        lib.tl_gelu_mul_bf16.argtypes = [_P, _P, _I, _I]
        lib.tl_gelu_mul_bf16.restype = None
        lib.tl_argmax_rows.argtypes = [ctypes.c_int, _P, _I, _I, _I, _P]
        lib.tl_argmax_rows.restype = ctypes.c_int
        self._lib = lib
        self.path = path
        self.has_avx512bf16 = bool(lib.tl_has_avx512bf16())
        # Whether tl_linear_qp is built (quantized weights are then packed at load: quantization.pack_panels).
        self.has_avx512vnni = bool(lib.tl_has_avx512vnni())

    def linear_bf16(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T`` for a few rows; x [M, K] and weight [N, K] contiguous bfloat16."""
        return self._linear_plain("linear_bf16", self._lib.tl_linear_bf16, torch.bfloat16, x, weight)

    def linear_bf16_blocked(self, x: torch.Tensor, tiles: torch.Tensor, n: int, block_n: int, pairs: int) -> torch.Tensor:
        """``x @ w.T`` for a few rows, w [n, K] held only in oneDNN's packed layout ``tiles`` (the flat
        bfloat16 bytes of ``AB<pairs>b<block_n>a2b``, see model/packed_weight.py)."""
        if x.dtype != torch.bfloat16 or tiles.dtype != torch.bfloat16 or x.dim() != 2 or not x.is_contiguous():
            raise ValueError("linear_bf16_blocked takes contiguous 2-D bfloat16 activations and bfloat16 tiles")
        m, k = x.shape
        n_pad, k_pad = BlockedLayout(block_n, pairs).padded_shape(n, k)
        if tiles.numel() != n_pad * k_pad:
            raise ValueError(f"linear_bf16_blocked: {tiles.numel()} packed values do not hold a [{n}, {k}] weight")
        y = torch.empty((m, n), dtype=torch.bfloat16)
        self._lib.tl_linear_bf16_blocked(x.data_ptr(), tiles.data_ptr(), y.data_ptr(), m, n, k, block_n, pairs)
        return y

    def linear_panels_f32(self, x: torch.Tensor, panels: torch.Tensor, n: int) -> torch.Tensor:
        """``x @ w.T`` in float32, w [n, K] held as column panels (model/panel_weight.py); x [M, K]
        contiguous, any M (fastest below layers.F32_PANEL_ROWS). A row's outputs do not depend on M."""
        if x.dtype != torch.float32 or panels.dtype != torch.float32 or x.dim() != 2 or panels.dim() != 3:
            raise ValueError("linear_panels_f32 takes 2-D float32 activations and 3-D float32 panels")
        m, k = x.shape
        if (not (x.is_contiguous() and panels.is_contiguous()) or panels.shape != (-(-n // PANEL), k, PANEL)):
            raise ValueError(f"linear_panels_f32: shapes {tuple(x.shape)} x {tuple(panels.shape)} do not hold a [{n}, {k}] product")
        y = torch.empty((m, n), dtype=torch.float32)
        self._lib.tl_linear_panels_f32(x.data_ptr(), panels.data_ptr(), y.data_ptr(), m, n, k)
        return y

    @staticmethod
    def _linear_plain(name: str, fn: Any, dtype: torch.dtype, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``fn(x, w, y, M, N, K)`` on a plain row-major weight of ``dtype``, after the checks."""
        if x.dtype != dtype or weight.dtype != dtype or x.dim() != 2 or weight.dim() != 2:
            raise ValueError(f"{name} takes 2-D {str(dtype).removeprefix('torch.')} activations and weights")
        if not (x.is_contiguous() and weight.is_contiguous()) or x.shape[1] != weight.shape[1]:
            raise ValueError(f"{name}: shapes {tuple(x.shape)} x {tuple(weight.shape)} or layout do not fit")
        m, k = x.shape
        n = weight.shape[0]
        y = torch.empty((m, n), dtype=dtype)
        fn(x.data_ptr(), weight.data_ptr(), y.data_ptr(), m, n, k)
        return y

    def linear_q(self, x: torch.Tensor, blocks: torch.Tensor, code: int, n: int) -> torch.Tensor:
        """``x @ w.T`` in float32 with w [n, K] held as quantized blocks (model/quantization.py;
        ``code`` its format's): x [M, K] contiguous float32, K a multiple of 32."""
        if x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous() or blocks.dtype != torch.uint8:
            raise ValueError("linear_q takes contiguous 2-D float32 activations and uint8 blocks")
        m, k = x.shape
        _check_blocks("linear_q", blocks, code, n, k)
        y = torch.empty((m, n), dtype=torch.float32)
        self._lib.tl_linear_q(code, x.data_ptr(), blocks.data_ptr(), y.data_ptr(), m, n, k)
        return y

    def linear_q_bf16(self, x: torch.Tensor, blocks: torch.Tensor, code: int, n: int) -> torch.Tensor:
        """``x @ w.T`` in float32 for bfloat16 rows x [M, K] (contiguous, K a multiple of 32), w [n, K]
        as quantized blocks: with AVX-512 BF16 each panel of 16 weight rows is expanded once into
        bfloat16 codes and multiplied with every row (vdpbf16ps), so it batches as the bfloat16 kernel
        does; elsewhere the rows are widened for ``linear_q``'s kernels. Exact products either way."""
        if x.dtype != torch.bfloat16 or x.dim() != 2 or not x.is_contiguous() or blocks.dtype != torch.uint8:
            raise ValueError("linear_q_bf16 takes contiguous 2-D bfloat16 activations and uint8 blocks")
        m, k = x.shape
        _check_blocks("linear_q_bf16", blocks, code, n, k)
        y = torch.empty((m, n), dtype=torch.float32)
        self._lib.tl_linear_q_bf16(code, x.data_ptr(), blocks.data_ptr(), y.data_ptr(), m, n, k)
        return y

    def linear_qp(self, x: torch.Tensor, blocks: torch.Tensor, code: int, n: int) -> torch.Tensor:
        """``x @ w.T`` in float32 for rows x [M, K] (float32 or bfloat16, contiguous) and w [n, K] in
        quantization.pack_panels' layout, with AVX-512 VNNI (``has_avx512vnni``): x is quantized to
        int8 per block of 32 (scale max|x| / 127, as llama.cpp quantizes activations for these formats),
        so the result differs from the dequantized weight times x by that rounding."""
        if x.dtype not in _DTYPE_CODES or x.dim() != 2 or not x.is_contiguous() or blocks.dtype != torch.uint8:
            raise ValueError("linear_qp takes contiguous 2-D float32 or bfloat16 activations and uint8 blocks")
        m, k = x.shape
        _check_blocks("linear_qp", blocks, code, n, k)
        if not self.has_avx512vnni or n % 16:
            raise ValueError("linear_qp needs AVX-512 VNNI and a weight of whole 16-row panels")
        y = torch.empty((m, n), dtype=torch.float32)
        self._lib.tl_linear_qp(code, _DTYPE_CODES[x.dtype], x.data_ptr(), blocks.data_ptr(), y.data_ptr(), m, n, k)
        return y

    def dequantize_q(self, blocks: torch.Tensor, code: int, n: int, k: int) -> torch.Tensor:
        """The float32 [n, k] weight held in ``blocks`` (format ``code``), as ggml dequantizes it."""
        _check_blocks("dequantize_q", blocks, code, n, k)
        out = torch.empty((n, k), dtype=torch.float32)
        self._lib.tl_dequantize_q(code, blocks.data_ptr(), out.data_ptr(), n, k)
        return out

    def rms_norm_bf16(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dimension of contiguous bfloat16 rows, rounding as the reference."""
        if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or x.shape[-1] != weight.shape[0]:
            raise ValueError("rms_norm_bf16 takes bfloat16 rows and a matching bfloat16 weight")
        x = x.contiguous()
        out = torch.empty_like(x)
        hidden = x.shape[-1]
        self._lib.tl_rms_norm_bf16(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // hidden, hidden, eps)
        return out

    def silu_mul_bf16(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of contiguous bfloat16 rows [..., 2I] (gate | up), as [..., I], rounded
        as the two tensor ops round."""
        return self._gated_mul_bf16("silu_mul_bf16", self._lib.tl_silu_mul_bf16, gate_up)

    def gelu_mul_bf16(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gelu(gate, approximate="tanh") * up`` of contiguous bfloat16 rows [..., 2I] (gate | up), as
        [..., I], rounded as the two tensor ops round (the bfloat16 decode layer's MLP activation)."""
        return self._gated_mul_bf16("gelu_mul_bf16", self._lib.tl_gelu_mul_bf16, gate_up)

    @staticmethod
    def _gated_mul_bf16(name: str, kernel: Any, gate_up: torch.Tensor) -> torch.Tensor:
        """``kernel(gate) * up`` of rows [..., 2I] (gate | up), as [..., I]: the two activations' one shape."""
        if gate_up.dtype != torch.bfloat16 or not gate_up.is_contiguous() or gate_up.shape[-1] % 2:
            raise ValueError(f"{name} takes contiguous bfloat16 rows of even width")
        width = gate_up.shape[-1] // 2
        out = torch.empty((*gate_up.shape[:-1], width), dtype=torch.bfloat16)
        kernel(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * width) if width else 0, width)
        return out

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor | None:
        """Each row's index of its largest value, the first on ties (``x.max(-1).indices``), of 2-D
        float32 or bfloat16 rows without NaN whose columns are contiguous (a column slice is fine);
        None where this build has no vector path for it (torch's then)."""
        if x.dim() != 2 or x.dtype not in _DTYPE_CODES or x.device.type != "cpu" or x.stride(1) != 1 or x.shape[1] == 0:
            return None
        out = torch.empty(x.shape[0], dtype=torch.long)
        done = self._lib.tl_argmax_rows(_DTYPE_CODES[x.dtype], x.data_ptr(), x.shape[0], x.shape[1], x.stride(0),
                                        out.data_ptr())
        return out if done else None

    def rotary_bf16_(self, qkv: torch.Tensor, num_heads: int, head_dim: int, cos: torch.Tensor,
                     sin: torch.Tensor) -> None:
        """Rotate the first ``num_heads`` heads (queries, then keys) of each qkv row in place.
        qkv [T, width] bfloat16 with unit stride along the row; cos, sin [T, head_dim] bfloat16."""
        tokens = qkv.shape[0]
        if qkv.dtype != torch.bfloat16 or qkv.stride(1) != 1 or num_heads * head_dim > qkv.shape[1]:
            raise ValueError("rotary_bf16_ takes bfloat16 rows holding the rotated heads first")
        if head_dim > 1024 or head_dim % 2:
            raise ValueError(f"rotary_bf16_: head_dim {head_dim} is not supported")
        cos = cos.reshape(tokens, head_dim).contiguous()
        sin = sin.reshape(tokens, head_dim).contiguous()
        self._lib.tl_rotary_bf16(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), tokens, num_heads,
                                 head_dim)

    def decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        max_context_len: int,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """One query token per sequence attending to its paged cache. q [D, H, Dh];
        caches [blocks, block_size, KVH, Dh] in q's dtype or bfloat16; block_tables [D, width] and
        context_lens [D] int64. ``window``: a query sees only its last ``window`` positions (its own
        included) and older blocks are never read; None or 0: all of them."""
        num_seqs, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        code, kv_code = _DTYPE_CODES.get(q.dtype), kv_dtype_code(k_cache, v_cache, q.dtype)
        if code is None or kv_code is None:
            raise ValueError(f"decode_attention supports float32 and bfloat16, got {q.dtype}/{k_cache.dtype}")
        if q.stride(2) != 1 or q.stride(1) != head_dim or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("decode_attention needs heads-contiguous queries and contiguous caches")
        if num_heads % num_kv_heads or block_tables.dtype != torch.int64 or context_lens.dtype != torch.int64:
            raise ValueError("decode_attention: head counts or index dtypes do not fit")
        tables = block_tables.contiguous()
        lens = context_lens.contiguous()
        out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype)
        self._lib.tl_decode_attention(
            code, kv_code, q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
            tables.shape[1], lens.data_ptr(), out.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim,
            block_size, max(1, max_context_len), scale, window or 0,
        )
        return out

    def prefill_attention_bf16_(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                spans: PrefillSpans, scale: float, out: torch.Tensor,
                                window: int | None = None) -> bool:
        """Causal attention of prefill spans over their paged bfloat16 cache (this step's K/V already
        in it), written into their rows of ``out`` (``window``: each query sees only its last
        ``window`` positions, as decode_attention). q [T, H, Dh] heads-contiguous, out [T, H, Dh]
        contiguous. False (nothing written) where this build or shape has no kernel: use SDPA."""
        _, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        if not (q.dtype == out.dtype == k_cache.dtype == v_cache.dtype == torch.bfloat16):
            return False
        if q.stride(2) != 1 or q.stride(1) != head_dim or not out.is_contiguous() or out.shape != q.shape:
            return False
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            return False
        done = self._lib.tl_prefill_attention_bf16(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_size, num_heads, num_kv_heads,
            head_dim, spans.count, spans.starts.data_ptr(), spans.num_tokens.data_ptr(), spans.context_lens.data_ptr(),
            spans.block_tables.data_ptr(), spans.block_tables.shape[1], scale, window or 0, out.data_ptr(),
        )
        if done < 0:
            raise MemoryError("prefill_attention_bf16_: scratch allocation failed")
        return done == 1

    def decode_layer_(self, x: torch.Tensor, w: DecodeLayerWeights, rows: DecodeRows, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, scratch: torch.Tensor) -> None:
        """One Llama decoder layer on decode rows x [M, H], in place: norm, q|k|v, RoPE, the K/V write
        into the paged cache, attention, o_proj + residual, norm, gate|up, SiLU * up, down + residual;
        with Gemma 3's options in ``w`` (q/k norms, post norms, GELU, its score scale) and the rows'
        sliding ``window``, that layer.
        x is float32 (float32 panels or quantized weights: ``tl_decode_layer_f32``) or bfloat16
        (oneDNN's packed bfloat16 tiles: ``tl_decode_layer_bf16``, the per-operator path's own
        kernels and roundings). ``scratch``: at least :func:`decode_layer_scratch` float32 values."""
        m, hidden = x.shape
        inter = w.intermediate
        dtype = torch.bfloat16 if w.fmt == BF16_PACKED else torch.float32
        if x.dtype != dtype or not x.is_contiguous() or not 1 <= m <= DECODE_LAYER_MAX_ROWS:
            raise ValueError(f"decode_layer_ takes 1..{DECODE_LAYER_MAX_ROWS} contiguous {dtype} rows for these weights")
        if hidden != w.input_norm.shape[0] or scratch.numel() < decode_layer_scratch(m, w) or w.head_dim % 2:
            raise ValueError("decode_layer_: rows, weights or scratch do not fit")
        kv_code = kv_dtype_code(k_cache, v_cache, dtype)
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or kv_code is None:
            raise ValueError(f"decode_layer_ needs contiguous caches in {dtype} or bfloat16")
        if (rows.cos.shape != (m, w.head_dim) or rows.cos.dtype != dtype or rows.slots.shape != (m,)
                or rows.block_tables.shape[0] != m):
            raise ValueError("decode_layer_: the step's rows do not fit x")
        opts = ctypes.byref(w.options(rows.window))
        scale = w.scale if w.scale is not None else 1.0 / math.sqrt(w.head_dim)
        if w.fmt == BF16_PACKED:
            assert w.blocking is not None
            self._lib.tl_decode_layer_bf16(
                x.data_ptr(), m, hidden, w.eps, w.input_norm.data_ptr(), w.qkv.data_ptr(), w.o.data_ptr(),
                w.post_norm.data_ptr(), w.gate_up.data_ptr(), w.down.data_ptr(), w.blocking.data_ptr(), inter, w.heads,
                w.kv_heads, w.head_dim, rows.cos.data_ptr(), rows.sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                rows.slots.data_ptr(), rows.block_tables.data_ptr(), rows.block_tables.shape[1],
                rows.context_lens.data_ptr(), k_cache.shape[1], max(1, rows.max_context_len),
                scale, scratch.data_ptr(), opts,
            )
            return
        self._lib.tl_decode_layer_f32(
            w.fmt | (BF16_ROWS_FLAG if w.bf16_rows else 0) | (PACKED_FLAG if w.packed else 0), kv_code, x.data_ptr(), m, hidden, w.eps, w.input_norm.data_ptr(), w.qkv.data_ptr(), w.o.data_ptr(),
            w.post_norm.data_ptr(), w.gate_up.data_ptr(), w.down.data_ptr(), inter, w.heads, w.kv_heads, w.head_dim,
            rows.cos.data_ptr(), rows.sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), rows.slots.data_ptr(),
            rows.block_tables.data_ptr(), rows.block_tables.shape[1], rows.context_lens.data_ptr(),
            k_cache.shape[1], max(1, rows.max_context_len), scale, scratch.data_ptr(), opts,
        )


def kv_dtype_code(k_cache: torch.Tensor, v_cache: torch.Tensor, q_dtype: torch.dtype) -> int | None:
    """The kernels' code for a KV cache beside ``q_dtype`` queries: the queries' own dtype, or
    bfloat16 beside float32 (``--kv-cache-dtype bfloat16``); None for any other pairing."""
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (q_dtype, torch.bfloat16):
        return None
    return _DTYPE_CODES.get(k_cache.dtype)


def _check_blocks(caller: str, blocks: torch.Tensor, code: int, n: int, k: int) -> None:
    """``blocks`` must hold a [n, k] weight of format ``code``, contiguous."""
    block_bytes = CODE_BLOCK_BYTES.get(code)
    if block_bytes is None or k % BLOCK or blocks.shape != (n, k // BLOCK * block_bytes) or not blocks.is_contiguous():
        raise ValueError(f"{caller}: blocks {tuple(blocks.shape)} do not hold a [{n}, {k}] weight of format {code}")


def decode_layer_scratch(rows: int, w: DecodeLayerWeights) -> int:
    """float32 values of scratch ``decode_layer_`` needs for ``rows`` rows: the activations, then the
    rows' sums over blocks of 32 (read with quantized weights); a bfloat16 layer's activations (two
    a float32 value) and the projection it adds back."""
    hidden, q_width = w.input_norm.shape[0], w.heads * w.head_dim
    qkv_width = q_width + 2 * w.kv_heads * w.head_dim
    if w.fmt == BF16_PACKED:
        return -(-rows * (2 * hidden + qkv_width + q_width + 3 * w.intermediate) // 2)
    widest = max(hidden, q_width, w.intermediate)
    # + the rows rounded to bfloat16 (two a float32 value) for DecodeLayerWeights.bf16_rows
    return rows * (hidden + qkv_width + q_width + 2 * w.intermediate + widest // BLOCK) + -(-rows * widest // 2)


# DecodeLayerWeights.fmt of oneDNN's packed bfloat16 tiles: not one of the C TL_W_* codes (those are
# tl_decode_layer_f32's), since a bfloat16 layer has its own entry point, tl_decode_layer_bf16.
BF16_PACKED = 3
# Added to a quantized fmt for tl_decode_layer_f32 (TL_W_BF16_ROWS): DecodeLayerWeights.bf16_rows.
BF16_ROWS_FLAG = 16
# Added to a quantized fmt for tl_decode_layer_f32 (TL_W_PACKED): DecodeLayerWeights.packed.
PACKED_FLAG = 32


class LayerOptions(ctypes.Structure):
    """csrc tl_layer_opts: what a decode layer adds to Llama's (NULL pointers and zeros: nothing)."""

    _fields_ = [("q_norm", _P), ("k_norm", _P), ("post_attn_norm", _P), ("post_ff_norm", _P),
                ("gelu", _I), ("window", _I), ("f32_norms", _I)]


@dataclass(frozen=True)
class DecodeLayerWeights:
    """One Llama layer's weights as ``decode_layer_`` reads them: float32 column panels
    (model/panel_weight.py), by ``fmt`` row-major quantized blocks, or oneDNN's packed bfloat16
    tiles (model/packed_weight.py) with bfloat16 norms (the tensors are held so their pointers stay
    valid)."""

    input_norm: torch.Tensor  # [H] float32 (bfloat16 beside packed tiles)
    qkv: torch.Tensor  # q | k | v rows: [(heads + 2 kv_heads) * head_dim, H]
    o: torch.Tensor  # [H, heads * head_dim]
    post_norm: torch.Tensor  # [H] float32
    gate_up: torch.Tensor  # gate | up rows: [2 I, H]
    down: torch.Tensor  # [H, I]
    eps: float
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # I
    # 0: float32 panels [ceil(N / 16), K, 16]; quantization.FORMAT_CODES: uint8 blocks [N, K / 32 * bytes];
    # BF16_PACKED: flat bfloat16 tiles, their (block_n, pairs) in ``blocking``.
    fmt: int = 0
    blocking: torch.Tensor | None = None  # [8] int64: (block_n, pairs) of qkv, o, gate_up, down
    # Quantized weights of a bfloat16 model: from layers.QUANTIZED_BF16_ROWS rows the projections'
    # inputs are rounded to bfloat16 (as the model's operators round them) for the batched kernel.
    bf16_rows: bool = False
    # Quantized blocks in quantization.pack_panels' layout (multiplied by tl_linear_qp's kernel).
    packed: bool = False
    # Gemma 3 beyond Llama: q/k norms [head_dim] before RoPE, norms [H] of o_proj's and down_proj's
    # outputs before each residual add (each None: none), tanh-GELU for SiLU, the score factor (None:
    # 1/sqrt(head_dim)). Zero-centred norms come folded (1 + w, float32); beside packed tiles
    # ``f32_norms`` says every norm of the layer is such a float32 weight, scaling before the rounding.
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None
    post_ff_norm: torch.Tensor | None = None
    gelu: bool = False
    scale: float | None = None
    f32_norms: bool = False

    def options(self, window: int | None) -> LayerOptions:
        """The kernel's options struct for this layer and the rows' sliding ``window``."""
        def ptr(t: torch.Tensor | None) -> int | None:
            return None if t is None else t.data_ptr()

        return LayerOptions(ptr(self.q_norm), ptr(self.k_norm), ptr(self.post_attn_norm), ptr(self.post_ff_norm),
                            int(self.gelu), window or 0, int(self.f32_norms))

    def check(self) -> None:
        extra = [t for t in (self.post_attn_norm, self.post_ff_norm) if t is not None]
        head_norms = [t for t in (self.q_norm, self.k_norm) if t is not None]
        norms, matrices = (self.input_norm, self.post_norm, *extra, *head_norms), (self.qkv, self.o, self.gate_up, self.down)
        bf16 = self.fmt == BF16_PACKED
        dtype = torch.float32 if self.fmt == 0 else torch.bfloat16 if bf16 else torch.uint8
        if (any(t.dtype != (torch.bfloat16 if bf16 and not self.f32_norms else torch.float32) for t in norms)
                or any(t.shape != (self.input_norm.shape[0],) for t in extra)
                or any(t.shape != (self.head_dim,) for t in head_norms)
                or (self.f32_norms and not bf16)
                or any(t.dtype != dtype for t in matrices)
                or any(t.device.type != "cpu" or not t.is_contiguous() for t in (*norms, *matrices))):
            raise ValueError("decode_layer_ takes contiguous CPU weights: float32 panels, uint8 blocks by fmt, "
                             "or bfloat16 tiles beside bfloat16 norms")
        if bf16 and (self.blocking is None or self.blocking.dtype != torch.int64 or self.blocking.shape != (8,)):
            raise ValueError("decode_layer_: packed bfloat16 tiles need their (block_n, pairs), four pairs of int64")
        hidden = self.input_norm.shape[0]
        q_width = self.heads * self.head_dim
        blocking = self.blocking.tolist() if bf16 and self.blocking is not None else []

        def shape(n: int, k: int, i: int) -> tuple[int, ...]:  # matrix i, [n, k], as this format holds it
            if bf16:
                n_pad, k_pad = BlockedLayout(blocking[2 * i], blocking[2 * i + 1]).padded_shape(n, k)
                return (n_pad * k_pad,)
            return (-(-n // PANEL), k, PANEL) if self.fmt == 0 else (n, k // BLOCK * CODE_BLOCK_BYTES[self.fmt])

        if (self.qkv.shape != shape(q_width + 2 * self.kv_heads * self.head_dim, hidden, 0)
                or self.o.shape != shape(hidden, q_width, 1) or self.gate_up.shape != shape(2 * self.intermediate, hidden, 2)
                or self.down.shape != shape(hidden, self.intermediate, 3)
                or (self.fmt and not bf16 and any(k % BLOCK for k in (hidden, q_width, self.intermediate)))):
            raise ValueError("decode_layer_: weight shapes do not fit one another")


@dataclass(frozen=True)
class DecodeRows:
    """A decode step's per-row inputs, shared by every layer: RoPE rows and where each row's K/V
    goes and attends (see attention.AttentionMetadata)."""

    cos: torch.Tensor  # [M, head_dim] float32 (bfloat16 for a bfloat16 layer: the per-operator path rotates with bfloat16 cos/sin)
    sin: torch.Tensor
    slots: torch.Tensor  # [M] int64
    block_tables: torch.Tensor  # [M, width] int64
    context_lens: torch.Tensor  # [M] int64
    max_context_len: int
    window: int | None = None  # a sliding KV cache group's: each row sees its last ``window`` positions


@dataclass(frozen=True)
class PrefillSpans:
    """A step's prefill spans as the prefill attention kernel reads them, built once per step and
    shared by every layer (see prefill_attention.PrefillSpan)."""

    starts: torch.Tensor  # [S] int64: first row of each span in the flat batch
    num_tokens: torch.Tensor  # [S] int64
    context_lens: torch.Tensor  # [S] int64: keys the span's last token sees, itself included
    block_tables: torch.Tensor  # [S, width] int64, padded with block 0

    @property
    def count(self) -> int:
        return int(self.starts.shape[0])


DECODE_LAYER_MAX_ROWS = 64  # the most rows one decode_layer_ call takes (its scratch is sized for them)


@functools.cache
def load() -> CpuKernels | None:
    """The kernels for this process, or None when disabled or they cannot be built here."""
    if os.environ.get("TOKENLINE_CPU_KERNELS", "1") == "0":
        return None
    try:
        return CpuKernels(build())
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = exc.stderr if isinstance(exc, subprocess.CalledProcessError) else exc
        log.warning("CPU kernels unavailable, using the torch path: %s", detail)
        return None
