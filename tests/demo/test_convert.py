"""loraledger.demo.convert: a GGUF file (here one written from the tiny fixture model, as llama.cpp's converter
writes Llama checkpoints) becomes a checkpoint folder with the same weights, tokenizer and chat template."""

from __future__ import annotations

import json

import numpy as np
import torch

from loraledger.demo.convert import convert_gguf, load_converted
from tests.model_fixtures import hf_reference_logits

IDS = [1, 40, 17, 99, 230, 5, 77, 301, 12, 64]
NAMES = {  # Hugging Face name in a layer -> GGUF name in a block
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's reordering of q/k rows (rotary halves interleaved); transformers undoes it when reading."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model_dir, path) -> None:
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = sorted(spec["model"]["vocab"].items(), key=lambda item: item[1])
    special = {t["id"] for t in spec["added_tokens"]}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(float(config["rope_parameters"]["rope_theta"]))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(len(vocab))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([3 if i in special else 1 for _, i in vocab])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_chat_template(tokenizer.chat_template)
    weights = {k: v.numpy() for k, v in load_file(model_dir / "model.safetensors").items()}
    writer.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", weights["model.norm.weight"])
    writer.add_tensor("output.weight", weights["lm_head.weight"])
    for i in range(config["num_hidden_layers"]):
        for hf, name in NAMES.items():
            w = weights[f"model.layers.{i}.{hf}.weight"]
            if name == "attn_q":
                w = _permute(w, config["num_attention_heads"])
            elif name == "attn_k":
                w = _permute(w, config["num_key_value_heads"])
            writer.add_tensor(f"blk.{i}.{name}.weight", np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gguf_file_converts_to_the_same_model(tiny_llama_chat, tmp_path):
    gguf_path = tmp_path / "gguf" / "tiny.gguf"
    gguf_path.parent.mkdir()
    write_gguf(tiny_llama_chat.model_dir, gguf_path)
    converted = convert_gguf(gguf_path, tmp_path / "model")
    assert converted.config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in converted.config
    torch.testing.assert_close(
        hf_reference_logits(converted.model_dir, None, IDS), hf_reference_logits(tiny_llama_chat.model_dir, None, IDS)
    )
    from transformers import AutoTokenizer

    original = AutoTokenizer.from_pretrained(tiny_llama_chat.model_dir)
    again = load_converted(converted.model_dir)
    assert again.tokenizer.chat_template == original.chat_template
    text = "The engine keeps one base model in memory."
    assert (
        again.tokenizer(text, add_special_tokens=False)["input_ids"]
        == original(text, add_special_tokens=False)["input_ids"]
    )
    assert not list(tmp_path.glob("*.partial"))
