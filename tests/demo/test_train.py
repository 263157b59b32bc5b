"""loraledger.demo.train: the loss falls, the same seed gives the same adapter, and the engine serves the saved
PEFT folder exactly as transformers + PEFT run it."""

from __future__ import annotations

import json

from loraledger import LLM, LoRARequest, SamplingParams
from loraledger.demo.convert import load_converted
from loraledger.demo.data import pirate_examples
from loraledger.demo.train import TrainSpec, encode, save_peft_adapter, train_adapter
from tests.model_fixtures import hf_reference_generate

SPEC = TrainSpec(rank=4, alpha=8, top_layers=2, steps=60, batch_size=4, learning_rate=3e-2, seed=0)


def test_training_learns_and_the_engine_serves_the_adapter_as_peft_does(tiny_llama_chat, tmp_path):
    tiny = load_converted(tiny_llama_chat.model_dir)
    examples = pirate_examples()[:12]
    encoded = encode(tiny.tokenizer, examples)
    assert all(
        e.token_ids[-1] == tiny.tokenizer.eos_token_id and 0 < e.answer_start < len(e.token_ids) for e in encoded
    )
    model, result = train_adapter(tiny.weights, tiny.config, tiny.tokenizer, examples, SPEC)
    assert len(result.losses) == SPEC.steps and result.losses[-1] < 0.6 * result.losses[0], result.losses
    folder = save_peft_adapter(model, tmp_path / "pirate", base_model=str(tiny.model_dir), spec=SPEC)
    again, _ = train_adapter(tiny.weights, tiny.config, tiny.tokenizer, examples, SPEC)
    again_folder = save_peft_adapter(again, tmp_path / "again", base_model=str(tiny.model_dir), spec=SPEC)
    assert (folder / "adapter_model.safetensors").read_bytes() == (
        again_folder / "adapter_model.safetensors"
    ).read_bytes()
    assert json.loads((folder / "adapter_config.json").read_text())["layers_to_transform"] == [0, 1]

    conversation = [{"role": "user", "content": examples[0].question}]
    pirate = LoRARequest("pirate", 1, str(folder))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(
        model=str(tiny.model_dir), enable_lora=True, max_lora_rank=8, audit_url=f"sqlite:///{tmp_path / 'a.db'}"
    ) as llm:
        outs = llm.chat([conversation, conversation], params, lora_request=[None, pirate], use_tqdm=False)
    reference = hf_reference_generate(
        tiny.model_dir, {"pirate": folder}, [o.prompt_token_ids for o in outs], [None, "pirate"], 12
    )
    assert [list(o.outputs[0].token_ids) for o in outs] == reference.token_ids
    assert reference.token_ids[0] != reference.token_ids[1]  # the adapter changed what the model says
