"""ModelRunner: a tiny scheduler-like driver over StepPlans; greedy output equals transformers + PEFT."""

from __future__ import annotations

import gc
import types

import pytest
import torch

from loraledger.errors import ConfigError, EngineDeadError, InternalError, LoRADisabledError
from loraledger.gpu.model_runner import ModelRunner
from loraledger.gpu.ops_torch import TorchOps
from loraledger.lora.checkpoint_reader import load_lora_checkpoint
from loraledger.scheduling.step_plan import PENDING_TOKEN, NewSeq, SamplingSpec, SeqWork, SlotLoad, StepPlan
from tests.model_fixtures import TinyModel, hf_reference_generate, hf_reference_logits

BLOCK_SIZE = 4
BLOCKS_PER_SEQ = 16


def _runner(tiny: TinyModel, *, enable_lora: bool = True, num_blocks: int = 128) -> ModelRunner:
    return ModelRunner(
        tiny.model_dir,
        dtype=torch.float32,
        device=torch.device("cpu"),
        ops=TorchOps(),
        num_kv_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        max_loras=4,
        max_lora_rank=16,
        enable_lora=enable_lora,
        max_num_batched_tokens=256,
    )


def _loads(tiny: TinyModel, names: list[str]) -> list[SlotLoad]:
    loads = []
    for slot, name in enumerate(names):
        ckpt = load_lora_checkpoint(
            str(tiny.adapters[name]), lora_name=name, lora_int_id=slot + 1, model_config=tiny.config, max_lora_rank=16
        )
        loads.append(SlotLoad(slot=slot, fingerprint=ckpt.fingerprint, checkpoint=ckpt))
    return loads


class Driver:
    """Runs sequences to completion: whole-prompt prefill, then one token per step; block i*16.. per sequence."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.step_id = 0

    def generate(self, prompts, slots, specs, max_new_tokens, *, first_plan_extra=None, seq_ids=None):
        seq_ids = seq_ids or list(range(len(prompts)))
        tables = {sid: list(range(sid * BLOCKS_PER_SEQ, (sid + 1) * BLOCKS_PER_SEQ)) for sid in seq_ids}
        outputs = {sid: [] for sid in seq_ids}
        logprobs = {sid: [] for sid in seq_ids}
        new = [NewSeq(sid, spec, list(p)) for sid, p, spec in zip(seq_ids, prompts, specs)]
        works = [SeqWork(sid, list(p), 0, tables[sid], slot, True) for sid, p, slot in zip(seq_ids, prompts, slots)]
        extra = first_plan_extra or {}
        for step in range(max_new_tokens):
            first = step == 0
            out = self.runner.execute(
                StepPlan(step_id=self.step_id, seqs=works, new_seqs=new if first else [], **(extra if first else {}))
            )
            self.step_id += 1
            for s in out.sampled:
                outputs[s.seq_id].append(s.token_id)
                logprobs[s.seq_id].append(s.logprob)
            works = [
                SeqWork(sid, [outputs[sid][-1]], len(p) + len(outputs[sid]) - 1, tables[sid], slot, True)
                for sid, p, slot in zip(seq_ids, prompts, slots)
            ]
        self.runner.execute(StepPlan(step_id=self.step_id, seqs=[], freed_seq_ids=seq_ids))
        self.step_id += 1
        return [outputs[sid] for sid in seq_ids], [logprobs[sid] for sid in seq_ids]

    def generate_overlapped(self, prompts, slots, specs, max_new_tokens, *, first_plan_extra=None, seq_ids=None):
        """generate() as the overlapped Scheduler and StepThread run it: step k+1 is launched, with each
        sequence's input as PENDING_TOKEN, before step k is finished."""
        seq_ids = seq_ids or list(range(len(prompts)))
        tables = {sid: list(range(sid * BLOCKS_PER_SEQ, (sid + 1) * BLOCKS_PER_SEQ)) for sid in seq_ids}
        outputs = {sid: [] for sid in seq_ids}
        logprobs = {sid: [] for sid in seq_ids}
        new = [NewSeq(sid, spec, list(p)) for sid, p, spec in zip(seq_ids, prompts, specs)]
        works = [SeqWork(sid, list(p), 0, tables[sid], slot, True) for sid, p, slot in zip(seq_ids, prompts, slots)]
        launched = self.runner.launch(StepPlan(self.step_id, seqs=works, new_seqs=new, **(first_plan_extra or {})))
        self.step_id += 1
        for step in range(1, max_new_tokens + 1):
            nxt = None
            if step < max_new_tokens:
                works = [
                    SeqWork(sid, [PENDING_TOKEN], len(p) + step - 1, tables[sid], slot, True)
                    for sid, p, slot in zip(seq_ids, prompts, slots)
                ]
                nxt = self.runner.launch(StepPlan(self.step_id, seqs=works))
                self.step_id += 1
            for s in self.runner.finish(launched).sampled:
                outputs[s.seq_id].append(s.token_id)
                logprobs[s.seq_id].append(s.logprob)
            launched = nxt
        self.runner.execute(StepPlan(step_id=self.step_id, seqs=[], freed_seq_ids=seq_ids))
        self.step_id += 1
        return [outputs[sid] for sid in seq_ids], [logprobs[sid] for sid in seq_ids]


@pytest.fixture(params=["llama", "qwen2", "qwen3"])
def tiny(request) -> TinyModel:
    return request.getfixturevalue(f"tiny_{request.param}")


def test_greedy_mixed_batch_equals_hf_generate(tiny):
    names = ["qv_r4", "all_r8", "ogd_r16_rslora"]
    prompts = [[1, 5, 9, 200, 33], [1, 7, 7, 12], [1, 100, 101, 102, 103, 104, 105], [1, 42], [1, 300, 301]]
    adapters = [None, "qv_r4", "all_r8", "ogd_r16_rslora", "all_r8"]
    slots = [-1 if a is None else names.index(a) for a in adapters]
    runner = _runner(tiny)
    tokens, logprobs = Driver(runner).generate(
        prompts, slots, [SamplingSpec()] * len(prompts), 8, first_plan_extra={"slot_loads": _loads(tiny, names)}
    )
    ref = hf_reference_generate(tiny.model_dir, tiny.adapters, prompts, adapters, 8, mixed=True)
    assert tokens == ref.token_ids
    for i in range(len(prompts)):
        expect = torch.log_softmax(ref.logits[i], -1).gather(1, torch.tensor(tokens[i])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(logprobs[i]), expect, rtol=0, atol=1e-4)
    assert len(set(map(tuple, tokens))) == len(set(map(tuple, ref.token_ids)))  # adapters change the output
    assert runner.num_live_seqs == 0


def test_overlapped_steps_take_the_pending_tokens_from_the_device(tiny):
    """Launching step k+1 before step k is finished (PENDING_TOKEN inputs) gives what one step at a time gives."""
    names = ["qv_r4", "all_r8"]
    prompts = [[1, 5, 9, 200, 33], [1, 7, 7, 12], [1, 100, 101], [1, 42]]
    slots = [-1, 0, 1, 1]
    specs = [
        SamplingSpec(),
        SamplingSpec(temperature=0.9, seed=11, top_k=20),
        SamplingSpec(temperature=1.0, seed=12, repetition_penalty=1.3, frequency_penalty=0.4),  # reads the history
        SamplingSpec(min_tokens=4, stop_ids=[2], logprobs=2),
    ]
    extra = {"slot_loads": _loads(tiny, names)}
    sync = Driver(_runner(tiny)).generate(prompts, slots, specs, 7, first_plan_extra=extra)
    runner = _runner(tiny)
    overlapped = Driver(runner).generate_overlapped(prompts, slots, specs, 7, first_plan_extra=extra)
    assert overlapped[0] == sync[0]
    torch.testing.assert_close(torch.tensor(overlapped[1]), torch.tensor(sync[1]), rtol=0, atol=1e-5)
    assert runner.num_live_seqs == 0


def test_overlapped_launch_rules(tiny_llama):
    runner = _runner(tiny_llama, enable_lora=False)
    runner.execute(
        StepPlan(0, seqs=[], new_seqs=[NewSeq(1, SamplingSpec(), [1, 2]), NewSeq(2, SamplingSpec(), [1, 3])])
    )
    with pytest.raises(
        InternalError,
        match=r"sequence 1 runs the token the previous step samples \(PENDING_TOKEN\), but step 0, launched before it, did not",
    ):
        runner.launch(StepPlan(1, seqs=[SeqWork(1, [PENDING_TOKEN], 2, [0], -1, True)]))
    first = runner.launch(
        StepPlan(2, seqs=[SeqWork(1, [1, 2], 0, [0], -1, True), SeqWork(2, [1, 3], 0, [1], -1, True)])
    )
    second = runner.launch(StepPlan(3, seqs=[SeqWork(1, [PENDING_TOKEN], 2, [0], -1, True)]))
    with pytest.raises(InternalError, match="finished out of order"):
        runner.finish(second)
    token = runner.finish(first).sampled[0].token_id
    assert runner.finish(second).sampled[0].seq_id == 1
    # a step whose launch fails takes its sequences' pending tokens with it: the next step drops them
    with pytest.raises(InternalError, match="block table"):
        runner.launch(
            StepPlan(4, seqs=[SeqWork(1, [PENDING_TOKEN], 3, [], -1, True), SeqWork(2, [9], 2, [1], -1, True)])
        )
    after = runner.execute(
        StepPlan(5, seqs=[SeqWork(1, [PENDING_TOKEN], 4, [0, 2], -1, True), SeqWork(2, [token], 2, [1], -1, True)])
    )
    assert [s.seq_id for s in after.sampled] == [2]


def test_seeded_sampling_is_independent_of_batch_and_survives_recompute(tiny_llama):
    spec = SamplingSpec(temperature=1.0, seed=77, top_p=0.9)
    prompt = [1, 5, 9, 200, 33]
    runner = _runner(tiny_llama, enable_lora=False)
    driver = Driver(runner)
    alone, _ = driver.generate([prompt], [-1], [spec], 6)
    others = [SamplingSpec(temperature=0.8, seed=1), SamplingSpec(), SamplingSpec(temperature=1.0, seed=2, top_k=5)]
    prompts = [[1, 2, 3], prompt, [1, 50], [1, 9, 9, 9]]
    batched, _ = driver.generate(prompts, [-1] * 4, [others[0], spec, others[1], others[2]], 6)
    assert batched[1] == alone[0]
    # preempted after 3 tokens: freed, re-announced with its output so far, the whole context recomputed
    runner.execute(StepPlan(step_id=100, seqs=[], new_seqs=[NewSeq(9, spec, prompt, alone[0][:3])]))
    context = prompt + alone[0][:3]
    table = list(range(64, 80))
    out = runner.execute(StepPlan(step_id=101, seqs=[SeqWork(9, context, 0, table, -1, True)]))
    assert out.sampled[0].token_id == alone[0][3]


def test_chunked_prompt_with_prompt_logprobs(tiny_qwen2):
    runner = _runner(tiny_qwen2)
    loads = _loads(tiny_qwen2, ["all_r8"])
    prompt = [1, 17, 250, 33, 8, 402, 96, 11, 300]
    spec = SamplingSpec(prompt_logprobs=2, logprobs=1)
    table = list(range(8))
    chunk = SeqWork(0, prompt[:5], 0, table, 0, False, True)
    first = runner.execute(StepPlan(0, seqs=[chunk], new_seqs=[NewSeq(0, spec, prompt)], slot_loads=loads))
    second = runner.execute(StepPlan(1, seqs=[SeqWork(0, prompt[5:], 5, table, 0, True, True)]))
    assert first.sampled == [] and len(second.sampled) == 1
    expect = torch.log_softmax(hf_reference_logits(tiny_qwen2.model_dir, tiny_qwen2.adapters["all_r8"], prompt), -1)
    (p1,), (p2,) = first.prompt_logprobs, second.prompt_logprobs
    assert (p1.first_pos, len(p1.logprobs), p2.first_pos, len(p2.logprobs)) == (1, 5, 6, 3)
    scored = torch.tensor(p1.logprobs + p2.logprobs)
    targets = torch.tensor(prompt[1:])[:, None]
    torch.testing.assert_close(scored, expect[:-1].gather(1, targets)[:, 0], rtol=0, atol=1e-4)
    top = torch.topk(expect[0], 2)
    assert [t for t, _ in p1.top_logprobs[0]] == top.indices.tolist()
    sampled = second.sampled[0]
    assert sampled.token_id == int(expect[-1].argmax())
    assert sampled.top_logprobs[0][0] == sampled.token_id
    assert second.forward_seconds > 0 and second.prepare_seconds > 0


def test_slot_clear_returns_the_sequence_to_the_base_model(tiny_llama):
    runner = _runner(tiny_llama)
    prompt = [1, 5, 9, 200, 33]
    driver = Driver(runner)
    loads = {"slot_loads": _loads(tiny_llama, ["all_r8"])}
    with_adapter, _ = driver.generate([prompt], [0], [SamplingSpec()], 4, first_plan_extra=loads)
    runner.execute(StepPlan(step_id=50, seqs=[], slot_clears=[0]))
    with pytest.raises(InternalError, match="holds no adapter"):
        driver.generate([prompt], [0], [SamplingSpec()], 1)
    runner.execute(StepPlan(step_id=51, seqs=[], freed_seq_ids=[0]))
    base, _ = driver.generate([prompt], [-1], [SamplingSpec()], 4)
    ref = hf_reference_generate(
        tiny_llama.model_dir, tiny_llama.adapters, [prompt, prompt], [None, "all_r8"], 4, mixed=False
    )
    assert base[0] == ref.token_ids[0] and with_adapter[0] == ref.token_ids[1]


def test_plan_errors_are_typed(tiny_llama):
    runner = _runner(tiny_llama, enable_lora=False)
    with pytest.raises(InternalError, match="never announced"):
        runner.execute(StepPlan(0, seqs=[SeqWork(5, [1, 2], 0, [0], -1, True)]))
    runner.execute(StepPlan(1, seqs=[], new_seqs=[NewSeq(5, SamplingSpec(), [1, 2])]))
    with pytest.raises(LoRADisabledError):
        runner.execute(StepPlan(2, seqs=[SeqWork(5, [1, 2], 0, [0], 0, True)]))
    with pytest.raises(InternalError, match="max_num_batched_tokens"):
        runner.execute(StepPlan(3, seqs=[SeqWork(5, [1] * 257, 0, list(range(65)), -1, True)]))
    runner.execute(StepPlan(4, seqs=[], new_seqs=[NewSeq(6, SamplingSpec(), [1] * 9)]))
    with pytest.raises(InternalError, match="block table has 2 blocks, 3 are needed"):
        runner.execute(StepPlan(5, seqs=[SeqWork(6, [1] * 9, 0, [0, 1], -1, True)]))


def _tensors_reachable(root: object) -> int:
    """How many tensors can be reached from `root` through attributes, slots and containers."""
    skip = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, str, bytes, int, float)
    seen, todo, found = set(), [root], 0
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found += 1
            continue
        todo.extend(gc.get_referents(obj))
    return found


def test_close_drops_every_tensor_and_refuses_later_steps(tiny_llama):
    runner = _runner(tiny_llama)
    driver = Driver(runner)
    driver.generate(
        [[5, 6, 7]], [0], [SamplingSpec()], 2, first_plan_extra={"slot_loads": _loads(tiny_llama, ["all_r8"])}
    )
    execute = runner.execute  # what an anyio worker thread may still hold after the last step
    assert _tensors_reachable(execute) > 20  # weights, KV cache, adapter slots
    runner.close()
    assert _tensors_reachable(execute) == 0  # nothing left to free off the event loop, at interpreter exit
    with pytest.raises(EngineDeadError, match="closed"):
        runner.execute(StepPlan(99, seqs=[]))


def test_bfloat16_mixed_batch_stays_close_to_fp32_hf(tiny_llama):
    runner = ModelRunner(
        tiny_llama.model_dir,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
        ops=TorchOps(),
        num_kv_blocks=64,
        block_size=BLOCK_SIZE,
        max_loras=4,
        max_lora_rank=16,
        enable_lora=True,
        max_num_batched_tokens=256,
    )
    names = ["qv_r4", "all_r8", "ogd_r16_rslora"]
    prompt = [1, 17, 250, 33, 8, 402, 96, 11, 300]
    spec = SamplingSpec(prompt_logprobs=0)
    works = [SeqWork(i, prompt, 0, list(range(4 * i, 4 * i + 4)), i - 1, True, True) for i in range(4)]
    new = [NewSeq(i, spec, prompt) for i in range(4)]
    out = runner.execute(StepPlan(0, seqs=works, new_seqs=new, slot_loads=_loads(tiny_llama, names)))
    for p in out.prompt_logprobs:
        adapter = None if p.seq_id == 0 else tiny_llama.adapters[names[p.seq_id - 1]]
        expect = torch.log_softmax(hf_reference_logits(tiny_llama.model_dir, adapter, prompt), -1)
        scored = expect[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(p.logprobs), scored, rtol=0.02, atol=0.1)


def test_cuda_graphs_need_a_cuda_device_and_cuda_ops(tiny_llama):
    with pytest.raises(ConfigError, match="CUDA graphs need a CUDA device and CudaOps"):
        ModelRunner(
            tiny_llama.model_dir,
            dtype=torch.float32,
            device=torch.device("cpu"),
            ops=TorchOps(),
            num_kv_blocks=16,
            block_size=BLOCK_SIZE,
            max_loras=1,
            max_lora_rank=8,
            enable_lora=False,
            max_num_batched_tokens=64,
            cuda_graph_max_batch=8,
        )
