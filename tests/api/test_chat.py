"""LLM.chat as vLLM's: rendered with the request's chat template as transformers applies it, one BOS, each conversation
on its own adapter; adapters that ship a tokenizer or a chat template use it for their requests."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest

from loraledger import LLM, LoRARequest, SamplingParams
from loraledger import errors as E
from loraledger.chat import render_chat
from tests.api.conftest import loras_for
from tests.model_fixtures import CHAT_TEMPLATE, hf_reference_generate

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
CONVERSATION = [
    {"role": "system", "content": "You answer in one sentence."},
    {"role": "user", "content": "What is the capital of France?"},
]
OTHER = [{"role": "user", "content": "How many legs does a spider have?"}]
ADAPTER_TEMPLATE = "{{ bos_token }}{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}[ANSWER]{% endif %}"


def _hf_chat_ids(tokenizer, conversation, **kwargs) -> list[int]:
    """transformers' own rendering and tokenization of a conversation."""
    return list(tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=True, **kwargs)["input_ids"])


@pytest.fixture(scope="module")
def chat_llm(tiny_llama_chat):
    with LLM(
        model=str(tiny_llama_chat.model_dir),
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
        block_size=4,
        audit_url=None,
    ) as llm:
        yield llm


@pytest.fixture(scope="module")
def base_tokenizer(tiny_llama_chat):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_chat.model_dir)


def test_chat_equals_the_template_applied_by_transformers_with_one_bos(chat_llm, tiny_llama_chat, base_tokenizer):
    """vLLM's LLM.chat: the template renders the text (here it writes BOS itself), which is tokenized without special
    tokens, so there is no second BOS; the greedy output is transformers' for those ids."""
    out = chat_llm.chat(CONVERSATION, GREEDY, use_tqdm=False)[0]
    expected = _hf_chat_ids(base_tokenizer, CONVERSATION, add_generation_prompt=True)
    assert out.prompt_token_ids == expected
    bos = base_tokenizer.bos_token_id
    assert expected[0] == bos and expected[1] != bos
    assert out.prompt == base_tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    ref = hf_reference_generate(tiny_llama_chat.model_dir, {}, [expected], [None], 6, mixed=False).token_ids[0]
    assert out.outputs[0].token_ids == ref


def test_each_conversation_is_bound_to_its_own_adapter(chat_llm, tiny_llama_chat, base_tokenizer):
    loras = loras_for(tiny_llama_chat)
    names = [None, "all_r8", "qv_r4"]
    convs = [CONVERSATION, OTHER, CONVERSATION]
    outs = chat_llm.chat(convs, GREEDY, lora_request=[loras[n] if n else None for n in names], use_tqdm=False)
    ids = [_hf_chat_ids(base_tokenizer, c, add_generation_prompt=True) for c in convs]
    ref = hf_reference_generate(
        tiny_llama_chat.model_dir, tiny_llama_chat.adapters, ids, names, 6, mixed=False
    ).token_ids
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert [o.lora_request.lora_name if o.lora_request else None for o in outs] == names
    with pytest.raises(E.LoRARequestError, match="2 entries for 3"):
        chat_llm.chat(convs, GREEDY, lora_request=[None, None], use_tqdm=False)


def test_the_given_template_its_kwargs_and_continue_final_message(chat_llm, base_tokenizer):
    template = "{{ bos_token }}{{ greeting }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    out = chat_llm.chat(
        OTHER,
        GREEDY,
        chat_template=template,
        chat_template_kwargs={"greeting": "Hello there. "},
        add_generation_prompt=False,
        use_tqdm=False,
    )[0]
    assert out.prompt == "<s>Hello there. user: How many legs does a spider have?\n"
    partial = [*OTHER, {"role": "assistant", "content": "A spider has"}]
    out = chat_llm.chat(partial, GREEDY, add_generation_prompt=False, continue_final_message=True, use_tqdm=False)[0]
    assert out.prompt_token_ids == _hf_chat_ids(base_tokenizer, partial, continue_final_message=True)
    assert out.prompt.endswith("A spider has")
    with pytest.raises(E.ChatTemplateError, match="cannot both be True"):
        chat_llm.chat(partial, GREEDY, continue_final_message=True, use_tqdm=False)


def test_text_parts_and_bad_messages(chat_llm, base_tokenizer):
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "How many legs"}, {"type": "text", "text": "does a spider have?"}],
        }
    ]
    joined = [{"role": "user", "content": "How many legs\ndoes a spider have?"}]
    assert chat_llm.chat(parts, GREEDY, use_tqdm=False)[0].prompt_token_ids == _hf_chat_ids(
        base_tokenizer, joined, add_generation_prompt=True
    )
    for bad, words in [
        ([{"content": "no role"}], "role"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "text"),
        ("just a string", "list of message dicts"),
        ([], "no messages"),
    ]:
        with pytest.raises(E.ChatTemplateError, match=words):
            chat_llm.chat(bad, GREEDY, use_tqdm=False)
    assert chat_llm.chat(OTHER, GREEDY, use_tqdm=False)[0].outputs[0].finish_reason == "length"


def test_a_tokenizer_without_a_chat_template_is_a_typed_error(llama_llm):
    with pytest.raises(E.ChatTemplateError, match="chat_template"):
        llama_llm.chat(CONVERSATION, GREEDY, use_tqdm=False)


# --- adapters that ship their own tokenizer or chat template ------------------------------------


def _swapped_tokenizer(model_dir, dest) -> tuple[int, int]:
    """Save beside an adapter a tokenizer whose ids of " the" and " and" are swapped: text tokenizes and decodes
    differently from the base tokenizer's, in the same vocabulary size. Returns the two ids (base " the", " and")."""
    raw = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = raw["model"]["vocab"]
    the, and_ = vocab["Ġthe"], vocab["Ġand"]
    vocab["Ġthe"], vocab["Ġand"] = and_, the
    (dest / "tokenizer.json").write_text(json.dumps(raw))
    shutil.copy(model_dir / "tokenizer_config.json", dest / "tokenizer_config.json")
    (dest / "chat_template.jinja").write_text(ADAPTER_TEMPLATE)
    return the, and_


@pytest.fixture(scope="module")
def shipped(tiny_llama_chat, tmp_path_factory):
    """Three copies of the all_r8 adapter: one with its own (different) tokenizer and chat template, one with only a
    chat template, one with tokenizer files that do not load."""
    root = tmp_path_factory.mktemp("shipped")
    source = tiny_llama_chat.adapters["all_r8"]
    folders = {name: root / name for name in ("own_tokenizer", "template_only", "broken")}
    for folder in folders.values():
        shutil.copytree(source, folder)
    swapped = _swapped_tokenizer(tiny_llama_chat.model_dir, folders["own_tokenizer"])
    (folders["template_only"] / "chat_template.jinja").write_text(ADAPTER_TEMPLATE)
    (folders["broken"] / "tokenizer.json").write_text("{not json")
    (folders["broken"] / "tokenizer_config.json").write_text("{}")
    loras = {name: LoRARequest(name, 10 + i, str(folder)) for i, (name, folder) in enumerate(folders.items())}
    return loras, swapped


def test_an_adapters_own_tokenizer_tokenizes_and_detokenizes_its_requests(chat_llm, shipped, base_tokenizer):
    from transformers import AutoTokenizer

    loras, (the, and_) = shipped
    lora = loras["own_tokenizer"]
    own = AutoTokenizer.from_pretrained(lora.lora_path)
    text = "The cat and the dog sleep in the warm sun"
    base_ids, own_ids = base_tokenizer(text)["input_ids"], own(text)["input_ids"]
    assert base_ids != own_ids and the in base_ids and and_ in own_ids
    on_adapter = chat_llm.generate(text, GREEDY, lora_request=lora, use_tqdm=False)[0]
    on_base = chat_llm.generate(text, GREEDY, use_tqdm=False)[0]
    assert on_adapter.prompt_token_ids == own_ids and on_base.prompt_token_ids == base_ids
    # detokenized with the adapter's tokenizer: forcing " the" in the base vocabulary writes " and" in its text
    forced = SamplingParams(temperature=0, max_tokens=1, allowed_token_ids=[the])
    assert chat_llm.generate(text, forced, lora_request=lora, use_tqdm=False)[0].outputs[0].text == " and"
    assert chat_llm.generate(text, forced, use_tqdm=False)[0].outputs[0].text == " the"
    assert chat_llm.get_tokenizer(lora)("the")["input_ids"] == own("the")["input_ids"]


def test_an_adapters_chat_template_renders_its_conversations_and_the_sha256_reaches_admission(
    tiny_llama_chat, shipped, base_tokenizer, monkeypatch
):
    from loraledger.actors import admission

    seen: dict[str, str | None] = {}
    original = admission.Admission._admit

    async def spy(self, msg):
        seen[msg.request_id] = msg.chat_template_sha256
        return await original(self, msg)

    monkeypatch.setattr(admission.Admission, "_admit", spy)
    loras, _ = shipped
    with LLM(
        model=str(tiny_llama_chat.model_dir), enable_lora=True, max_loras=2, max_lora_rank=16, audit_url=None
    ) as llm:
        outs = llm.chat(
            [OTHER] * 3, GREEDY, lora_request=[None, loras["own_tokenizer"], loras["template_only"]], use_tqdm=False
        )
        plain = llm.generate("How many legs does a spider have?", GREEDY, use_tqdm=False)[0]
    assert outs[0].prompt.startswith("<s><|user|>")
    assert outs[1].prompt == outs[2].prompt == "<s>[USER] How many legs does a spider have?\n[ANSWER]"
    assert outs[2].prompt_token_ids == base_tokenizer.encode(outs[2].prompt, add_special_tokens=False)
    digest = {t: hashlib.sha256(t.encode()).hexdigest() for t in (CHAT_TEMPLATE, ADAPTER_TEMPLATE)}
    assert [seen[o.audit_id] for o in outs] == [
        digest[CHAT_TEMPLATE],
        digest[ADAPTER_TEMPLATE],
        digest[ADAPTER_TEMPLATE],
    ]
    assert seen[plain.audit_id] is None


def test_an_adapters_tokenizer_that_does_not_load_refuses_its_requests(chat_llm, shipped):
    loras, _ = shipped
    with pytest.raises(E.AdapterFormatError, match="tokenizer"):
        chat_llm.chat(OTHER, GREEDY, lora_request=loras["broken"], use_tqdm=False)
    with pytest.raises(E.AdapterFormatError, match="tokenizer"):
        chat_llm.generate("How many legs", GREEDY, lora_request=loras["broken"], use_tqdm=False)
    assert chat_llm.generate("How many legs", GREEDY, use_tqdm=False)[0].finished


def test_render_chat_reports_the_template_it_used(base_tokenizer):
    rendered = render_chat(base_tokenizer, OTHER)
    assert rendered.template_sha256 == hashlib.sha256(CHAT_TEMPLATE.encode()).hexdigest()
    assert rendered.token_ids == base_tokenizer.encode(rendered.text, add_special_tokens=False)
    given = render_chat(base_tokenizer, OTHER, chat_template=ADAPTER_TEMPLATE)
    assert given.template_sha256 == hashlib.sha256(ADAPTER_TEMPLATE.encode()).hexdigest()


def test_documents_reach_the_template_as_transformers_gives_them(base_tokenizer):
    """`documents` (a list of dicts) go to apply_chat_template(documents=...), also through chat_template_kwargs, as
    LLM.chat's callers and the server's `documents` field send them; anything else is a ChatTemplateError."""
    template = "{% for d in documents or [] %}[{{ d['title'] }}] {% endfor %}" + CHAT_TEMPLATE
    docs = [{"title": "a", "text": "x"}, {"title": "b", "text": "y"}]
    given = render_chat(base_tokenizer, OTHER, chat_template=template, documents=docs)
    assert given.text == base_tokenizer.apply_chat_template(
        OTHER, chat_template=template, documents=docs, tokenize=False, add_generation_prompt=True
    )
    assert given.text.startswith("[a] [b] ")
    through_kwargs = render_chat(
        base_tokenizer, OTHER, chat_template=template, chat_template_kwargs={"documents": docs}
    )
    assert through_kwargs == given
    assert not render_chat(base_tokenizer, OTHER, chat_template=template).text.startswith("[")
    for bad in ("text", [1, 2], {"title": "a"}):
        with pytest.raises(E.ChatTemplateError, match="documents"):
            render_chat(base_tokenizer, OTHER, chat_template=template, documents=bad)
