"""Quantized checkpoints of the tiny Llama, written in the tests, each beside a float copy of exactly the weights it
dequantizes to (the reference transformers + PEFT run).

Every projection is round-to-nearest quantized (4 or 8 bits, per group, symmetric or not; GPTQ desc_act with a
scattered g_idx) and the integers, scales and zero points are written in each format's layout as its documentation
gives it (loraledger/quantization/packing.py cites it; tests/quantization/test_packing.py checks the packers). The
float copy is computed from the integers before packing, so the engine's unpacking is checked against it too.
GGUF files are written with the `gguf` package itself (its Q4_0 / Q4_1 / Q8_0 quantizers), q/k rows in llama.cpp's
rotary order as its converter writes them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from loraledger.quantization.nf4 import LEVELS
from loraledger.quantization.packing import AWQ_ORDER, pack_int32, pack_int32_padded

# Every format the tests write the tiny Llama in, under one name each: name -> (method, write_quantized arguments).
# Each test module serves the ones it needs (tests/quantization/test_quantized_engine.py, tests/gpu/conftest.py,
# tests/gpu/test_quant_cuda_engine.py); GGUF files are named by their tensor type.
QUANTIZED_FORMATS: dict[str, tuple[str, dict]] = {
    "ct-w4-g32-sym": ("compressed-tensors", dict(bits=4, group=32, sym=True)),
    "ct-w4-g32-asym": ("compressed-tensors", dict(bits=4, group=32, sym=False)),
    "ct-w4-g64-sym": ("compressed-tensors", dict(bits=4, group=64, sym=True)),
    "ct-w4-g64-asym": ("compressed-tensors", dict(bits=4, group=64, sym=False)),
    "ct-w8-channel": ("compressed-tensors", dict(bits=8, group=None, sym=True)),
    "gptq-g_idx": ("gptq", dict(bits=4, group=32, sym=False, desc_act=True)),
    "gptq-w8a16-g64": ("gptq", dict(bits=8, group=64, sym=True)),
    "awq": ("awq", dict(bits=4, group=64, sym=False)),
    "bnb-int8": ("bitsandbytes", dict(bits=8, group=None, sym=True)),
    "nf4": ("bitsandbytes", dict(bits=4, group=64, sym=True)),
    "nf4-double-quant": ("bitsandbytes", dict(bits=4, group=64, sym=True, desc_act=True)),  # nested absmax
}
GGUF_KINDS = ("Q4_0", "Q4_1", "Q8_0")


PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
PROJECTIONS += ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def rtn(w: torch.Tensor, bits: int, group: int | None, symmetric: bool, g_idx: torch.Tensor | None = None):
    """(q unsigned int32 [out, in], scale fp32 [out, G] (fp16 values), zero int32 [out, G]): w ~ (q - zero) * scale,
    column k in group g_idx[k] (default k // group)."""
    out, k = w.shape
    g_idx = torch.arange(k) // (group or k) if g_idx is None else g_idx
    groups = int(g_idx.max()) + 1
    top = 2**bits - 1
    scale = torch.empty(out, groups)
    zero = torch.empty(out, groups, dtype=torch.int32)
    for g in range(groups):
        cols = w[:, g_idx == g]
        if symmetric:
            s = cols.abs().amax(1) / (2 ** (bits - 1) - 1)
            z = torch.full((out,), 2 ** (bits - 1), dtype=torch.int32)
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            s = (hi - lo) / top
            z = torch.round(-lo / s.clamp(min=1e-8)).clamp(1, top).to(torch.int32)  # GPTQ stores zero - 1: keep it >= 0
        scale[:, g] = s.clamp(min=1e-6).half().float()
        zero[:, g] = z
    q = torch.clamp(torch.round(w / scale[:, g_idx]) + zero[:, g_idx], 0, top).to(torch.int32)
    return q, scale, zero, g_idx


NF4 = LEVELS  # the 16 levels are a definition (bitsandbytes'); the rounding below is this module's own


def nf4(w: torch.Tensor, *, nested: bool, blocksize: int = 64) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(bitsandbytes' serialized nf4 tensors of w, the fp32 weight they dequantize to); `nested`: double
    quantization of the absmax (8-bit codes into a 256-entry map, per 256 blocks, plus an offset)."""
    import json

    out, k = w.shape
    flat = w.reshape(-1, blocksize)
    absmax = flat.abs().amax(1)
    tensors = {"weight.quant_map": NF4.clone()}
    state = {"quant_type": "nf4", "blocksize": blocksize, "dtype": "float32", "shape": [out, k]}
    if nested:
        offset = float(absmax.mean())
        per, n = 256, absmax.numel()  # bitsandbytes' nested blocks: 256 absmax each, the last one partial
        groups = torch.cat([absmax - offset, torch.zeros(-n % per)]).reshape(-1, per)
        nested_absmax = groups.abs().amax(1).clamp(min=1e-8)
        nested_map = torch.linspace(-1, 1, 256)
        codes8 = torch.argmin((groups / nested_absmax[:, None])[..., None].sub(nested_map).abs(), dim=-1).reshape(-1)
        codes8 = codes8[:n]
        absmax = nested_map[codes8] * nested_absmax[torch.arange(codes8.numel()) // per] + offset
        tensors.update({"weight.absmax": codes8.to(torch.uint8), "weight.nested_absmax": nested_absmax,
                        "weight.nested_quant_map": nested_map})  # fmt: skip
        state.update(nested_blocksize=per, nested_dtype="float32", nested_offset=offset)
    else:
        tensors["weight.absmax"] = absmax
    codes = torch.argmin((flat / absmax[:, None])[..., None].sub(NF4).abs(), dim=-1).reshape(-1)
    tensors["weight"] = ((codes[0::2] << 4) | codes[1::2]).to(torch.uint8).reshape(-1, 1)
    tensors["weight.quant_state.bitsandbytes__nf4"] = torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)
    return tensors, (NF4[codes].reshape(-1, blocksize) * absmax[:, None]).reshape(out, k)


def _dequant(q, scale, zero, g_idx) -> torch.Tensor:
    return (q - zero[:, g_idx]).float() * scale[:, g_idx]


def _copy_model_files(src: Path, dest: Path, config_extra: dict | None) -> dict:
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("model.safetensors", "config.json"))
    config = json.loads((src / "config.json").read_text())
    if config_extra:
        config.update(config_extra)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return config


def write_quantized(src: Path, root: Path, method: str, *, bits: int = 4, group: int | None = 32, sym: bool = False,
                    desc_act: bool = False) -> tuple[Path, Path]:  # fmt: skip
    """(quantized checkpoint folder, float folder of its dequantized weights) for method "compressed-tensors",
    "gptq", "awq" or "bitsandbytes" (bits=8: int8 per row; bits=4: nf4, double-quantized when desc_act)."""
    name = f"{method}-{bits}b-g{group}-{'sym' if sym else 'asym'}{'-act' if desc_act else ''}"
    qdir, fdir = root / name, root / f"{name}-float"
    weights = load_file(str(src / "model.safetensors"))
    quantized, dequantized = {}, dict(weights)
    gen = torch.Generator().manual_seed(11)
    for key, w in weights.items():
        prefix = key.removesuffix(".weight")
        if not prefix.endswith(PROJECTIONS):
            quantized[key] = w
            continue
        w = w.float()
        out, k = w.shape
        g_idx = None
        if desc_act:  # activation order: each group's columns scattered over the row
            g_idx = (torch.arange(k) // group)[torch.randperm(k, generator=gen)]
        if method == "bitsandbytes" and bits == 4:
            tensors, dequantized[key] = nf4(w, nested=desc_act)
            quantized.update({f"{prefix}.{name}": t for name, t in tensors.items()})
            continue
        if method == "bitsandbytes":
            scb = (w.abs().amax(1) / 127).half().float() * 127  # SCB / 127 an fp16 value: the fp32 copy is exact
            q8 = torch.round(w * 127 / scb[:, None]).clamp(-127, 127).to(torch.int8)
            quantized[key], quantized[f"{prefix}.SCB"] = q8, scb
            dequantized[key] = q8.float() * (scb / 127)[:, None]
            continue
        q, scale, zero, g_idx = rtn(w, bits, group, sym, g_idx)
        dequantized[key] = _dequant(q, scale, zero, g_idx)
        if method == "compressed-tensors":
            quantized[f"{prefix}.weight_packed"] = pack_int32(q, bits, dim=1)
            quantized[f"{prefix}.weight_scale"] = scale.half()
            quantized[f"{prefix}.weight_shape"] = torch.tensor([out, k])
            if not sym:  # packed along the output dim, as compressed-tensors' pack_to_int32(zp, bits, packed_dim=0)
                quantized[f"{prefix}.weight_zero_point"] = pack_int32_padded(zero, bits, dim=0)
        elif method == "gptq":
            quantized[f"{prefix}.qweight"] = pack_int32(q.t(), bits, dim=0)
            quantized[f"{prefix}.qzeros"] = pack_int32((zero - 1).t(), bits, dim=1)
            quantized[f"{prefix}.scales"] = scale.t().half().contiguous()
            quantized[f"{prefix}.g_idx"] = g_idx.to(torch.int32)
        elif method == "awq":
            order = list(AWQ_ORDER)

            def awq_pack(cols: torch.Tensor) -> torch.Tensor:  # nibble i of a word holds column 8 * word + order[i]
                rows = cols.shape[0]
                return pack_int32(cols.reshape(rows, -1, 8)[..., order].reshape(rows, -1), 4, dim=1)

            quantized[f"{prefix}.qweight"] = awq_pack(q.t().contiguous())
            quantized[f"{prefix}.qzeros"] = awq_pack(zero.t().contiguous())
            quantized[f"{prefix}.scales"] = scale.t().half().contiguous()
    spec = _quant_config(method, bits, group, sym, desc_act)
    _copy_model_files(src, qdir, {"quantization_config": spec})
    save_file({k: v.contiguous() for k, v in quantized.items()}, str(qdir / "model.safetensors"))
    _copy_model_files(src, fdir, None)
    save_file({k: v.float().contiguous() for k, v in dequantized.items()}, str(fdir / "model.safetensors"))
    return qdir, fdir


def _quant_config(method: str, bits: int, group: int | None, sym: bool, desc_act: bool) -> dict:
    if method == "compressed-tensors":
        weights = {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": "group" if group else "channel",
                   "group_size": group, "dynamic": False, "actorder": None}  # fmt: skip
        return {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
            "ignore": ["lm_head"],
            "quantization_status": "compressed",  # the packed tensors are on disk (llmcompressor writes it)
        }
    if method == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group or -1, "sym": sym, "desc_act": desc_act,
                "checkpoint_format": "gptq"}  # fmt: skip
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": not sym, "version": "gemm"}
    if bits == 4:
        return {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                "bnb_4bit_use_double_quant": desc_act, "bnb_4bit_compute_dtype": "float32"}  # fmt: skip
    return {"quant_method": "bitsandbytes", "load_in_8bit": True}


def _llama_cpp_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order (transformers' loader undoes it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def encode_q4_k(w: np.ndarray) -> np.ndarray:
    """Q4_K super-blocks [rows, cols / 256 * 144] of a float weight, in llama.cpp's layout (the gguf package reads
    Q4_K but cannot write it): per 32-element sub-block j, w ~ d * sc_j * q - dmin * m_j with 6-bit sc_j, m_j."""
    rows, cols = w.shape
    sub = w.reshape(rows, cols // 256, 8, 32).astype(np.float32)
    lo = np.minimum(sub.min(-1), 0.0)
    scale, mins = (sub.max(-1) - lo) / 15.0, -lo
    d = (scale.max(-1) / 63.0).astype(np.float16).astype(np.float32)
    dmin = (mins.max(-1) / 63.0).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / np.maximum(d[..., None], 1e-12)), 1, 63).astype(np.int32)
    m = np.clip(np.round(mins / np.maximum(dmin[..., None], 1e-12)), 0, 63).astype(np.int32)
    step = d[..., None] * sc
    q = np.clip(np.round((sub + (dmin[..., None] * m)[..., None]) / step[..., None]), 0, 15).astype(np.uint8)
    scales = np.empty(sc.shape[:-1] + (12,), np.uint8)
    scales[..., 0:4] = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    scales[..., 4:8] = (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6)
    scales[..., 8:12] = (sc[..., 4:] & 0xF) | ((m[..., 4:] & 0xF) << 4)
    qs = (q[..., 0::2, :] | (q[..., 1::2, :] << 4)).reshape(rows, cols // 256, 128)  # chunk c: sub-blocks 2c, 2c+1
    head = np.concatenate([d[..., None].astype(np.float16).view(np.uint8).reshape(rows, -1, 2),
                           dmin[..., None].astype(np.float16).view(np.uint8).reshape(rows, -1, 2)], axis=-1)  # fmt: skip
    return np.concatenate([head, scales, qs], axis=-1).reshape(rows, -1)


def write_gguf(src: Path, path: Path, kind: str, embedding: str | None = None, tied: bool = False) -> Path:
    """The tiny Llama as a GGUF file whose projections are `kind` (Q4_0, Q4_1, Q8_0 or Q4_K; the rest F32), its
    token embedding and output `embedding` (a GGUF type; None: F32); `tied` leaves the output out (llama.cpp's tie)."""
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    config = json.loads((src / "config.json").read_text())
    weights = {k: v.float().numpy() for k, v in load_file(str(src / "model.safetensors")).items()}
    writer = GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_rope_dimension_count(config["hidden_size"] // config["num_attention_heads"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
    writer.add_vocab_size(config["vocab_size"])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    qtype = GGMLQuantizationType[kind]
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}  # fmt: skip
    for key, w in weights.items():
        if key in ("model.embed_tokens.weight", "lm_head.weight"):
            name = "token_embd.weight" if key == "model.embed_tokens.weight" else "output.weight"
            if key == "lm_head.weight" and tied:
                continue
            if embedding is None:
                writer.add_tensor(name, w)
            else:
                writer.add_tensor(
                    name, quants.quantize(w, GGMLQuantizationType[embedding]), raw_dtype=GGMLQuantizationType[embedding]
                )
        elif key == "model.norm.weight":
            writer.add_tensor("output_norm.weight", w)
        else:
            layer, module = key.removeprefix("model.layers.").removesuffix(".weight").split(".", 1)
            name = f"blk.{layer}.{names[module]}.weight"
            if module in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = config["num_attention_heads"] if module.endswith("q_proj") else config["num_key_value_heads"]
                w = _llama_cpp_rows(w, heads)
            if w.ndim == 2 and kind == "Q4_K":
                writer.add_tensor(name, encode_q4_k(w), raw_dtype=qtype)
            elif w.ndim == 2:
                writer.add_tensor(name, quants.quantize(w, qtype), raw_dtype=qtype)
            else:
                writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def build_wide_llama(root: Path) -> tuple[Path, dict[str, Path]]:
    """A tiny Llama whose rows are a whole number of Q4_K super-blocks (hidden 256, intermediate 512), with two
    PEFT adapters (rank 8 on all seven projections; rank 4 on q and v)."""
    import copy

    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from loraledger.assets import build_tokenizer

    model_dir = root / "wide-llama"
    vocab = build_tokenizer(model_dir, vocab_size=512)
    torch.manual_seed(4)
    model = LlamaForCausalLM(
        LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=256, bos_token_id=1,
                    eos_token_id=2, pad_token_id=3, initializer_range=0.06, tie_word_embeddings=False)
    )  # fmt: skip
    model.save_pretrained(model_dir, safe_serialization=True)
    adapters = {}
    for n, (name, rank, targets) in enumerate(
        [("all_r8", 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
         ("qv_r4", 4, ["q_proj", "v_proj"])]
    ):  # fmt: skip
        torch.manual_seed(40 + n)
        lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False,
                          lora_dropout=0.0, task_type="CAUSAL_LM")  # fmt: skip
        adapters[name] = root / f"wide-llama-{name}"
        get_peft_model(copy.deepcopy(model), lora).save_pretrained(adapters[name])
    return model_dir, adapters
