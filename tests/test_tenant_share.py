"""Fair shares of the engine step across tenants (replica/tenant_share.py).

Scheduler tests drive ``Scheduler`` with no model (each step's plan is applied by hand: tokens
computed, one sampled token per finished prefill), so they assert exact plans; engine tests on
the tiny random Llama check that the policy never changes greedy output."""

from __future__ import annotations

import itertools
import random

import pytest

from replica import LLM, SamplingParams
from replica.block_manager import BlockManager
from replica.config import EngineConfig
from replica.engine_request import EngineRequest
from replica.scheduler import Scheduler
from replica.sequence import Request, Sequence
from replica.tenant_share import TenantShares


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Harness:
    """A scheduler, its requests, and a fake forward that applies each step's plan."""

    def __init__(self, num_blocks: int = 256, **config) -> None:
        config.setdefault("max_num_batched_tokens", 256)
        config.setdefault("tenant_prefill_chunk", 16)
        self.config = EngineConfig(**config)
        self.bm = BlockManager(num_blocks, self.config.block_size)
        self.sched = Scheduler(self.config, self.bm, "test-model")
        self.clock = Clock()
        if self.sched.shares is not None:
            self.sched.shares.clock = self.clock
        self.ids = itertools.count()
        self.rng = random.Random(0)

    def add(self, tenant: str, prompt_len: int, max_tokens: int = 4, priority: int = 0) -> Sequence:
        n = next(self.ids)
        tokens = [self.rng.randrange(5, 400) for _ in range(prompt_len)]
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        record = EngineRequest(f"{tenant}{n}", tokens, params, priority, tenant, tenant=tenant)
        request = Request(record, tokens, float(n))
        seq = Sequence(n, request, 0, list(tokens), prompt_len)
        request.sequences.append(seq)
        self.sched.add(seq)
        return seq

    def step(self) -> list[tuple[str, int]]:
        """One step: (request id, tokens) per scheduled sequence, in batch order."""
        out = self.sched.schedule()
        plan = []
        for item in out.scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            self.sched.prefix.cache_computed_blocks(seq)
            plan.append((seq.request.request_id, item.num_new_tokens))
            if seq.num_computed_tokens == seq.num_tokens:  # logits: one token sampled
                seq.token_ids.append(self.rng.randrange(5, 400))
                if seq.num_output_tokens >= seq.request.params.max_tokens:
                    self.sched.finish(seq)
        self.check()
        return plan

    def check(self) -> None:
        tables = [s.block_table for s in self.sched.running + self.sched.waiting]
        self.bm.check_integrity(tables)
        assert all(not s.block_table for s in self.sched.waiting)


def prefill_tokens(plan: list[tuple[str, int]], tenant: str) -> int:
    return sum(n for rid, n in plan if rid.startswith(tenant) and n > 1)


def flood(h: Harness, requests: int = 4, prompt_len: int = 384) -> list[Sequence]:
    seqs = [h.add("flood", prompt_len, max_tokens=32) for _ in range(requests)]
    for _ in range(3):
        h.clock.now += 0.1
        h.step()
    return seqs


def test_a_light_tenant_prefills_in_the_next_step_beside_a_flood():
    h = Harness()
    flood(h)
    calm = h.add("calm", 64)
    plan = h.step()
    assert ("calm4", 64) in plan  # its whole prompt at once: its first token is this step's
    assert calm.num_output_tokens == 1
    assert prefill_tokens(plan, "flood") == 0  # the step carrying it carries no other prefill
    assert sum(n == 1 for _, n in plan) == 2  # the flood's decodes still run
    plan = h.step()
    assert prefill_tokens(plan, "flood") == 16  # then the flood's chunk again


def test_without_fairness_the_flood_runs_first():
    h = Harness(tenant_fairness=False)
    flood(h)
    h.add("calm", 64)
    plan = h.step()
    assert "calm4" not in dict(plan)  # FCFS: the flood's prefill chunks fill the budget
    assert prefill_tokens(plan, "flood") > 200


def test_while_another_tenant_is_present_a_flood_gets_small_steps():
    h = Harness(tenant_window_s=5.0)
    calm = h.add("calm", 64, max_tokens=1)
    h.step()
    assert calm.finished  # gone, but present for 5 s
    seqs = flood(h)
    plan = h.step()
    assert prefill_tokens(plan, "flood") == 16
    h.clock.now += 5.1  # the calm tenant is no longer present: the flood has the budget
    plan = h.step()
    assert prefill_tokens(plan, "flood") == 256
    assert all(s.num_output_tokens == 0 for s in seqs[2:])


def test_decodes_are_never_held_back():
    h = Harness(max_num_batched_tokens=64, tenant_prefill_chunk=16)
    decoding = [h.add("flood", 16, max_tokens=50) for _ in range(3)]
    h.step()
    h.add("flood", 300)
    h.add("calm", 40)
    plan = dict(h.step())
    assert all(plan[s.request.request_id] == 1 for s in decoding)
    assert plan["calm4"] == 40
    assert "flood3" not in plan
    plan = dict(h.step())
    assert plan["flood3"] == 16 and all(plan[s.request.request_id] == 1 for s in decoding)


def test_least_served_tenant_is_admitted_first_even_when_later():
    h = Harness(max_num_seqs=2, tenant_prefill_chunk=256)
    h.add("flood", 32, max_tokens=100)
    h.add("flood", 32, max_tokens=100)
    h.step()
    h.add("flood", 32)  # waiting: max_num_seqs is 2
    h.add("calm", 32)
    h.sched.finish(h.sched.running[0])
    plan = dict(h.step())
    assert "calm3" in plan and "flood2" not in plan


def test_a_returning_tenant_gets_at_most_one_step_of_credit():
    clock = Clock()
    shares = TenantShares(prefill_chunk=16, window_s=100.0, burst=256, clock=clock)
    shares.enter("a")
    shares.charge("a", 10_000)
    shares.enter("b")  # a is busy: b starts one budget below it
    assert shares.served["b"] == 10_000 - 256
    shares.leave("b")
    shares.charge("b", 100)
    shares.charge("a", 5_000)
    shares.enter("b")  # lifted again: no credit banked while idle
    assert shares.served["b"] == 15_000 - 256
    shares.leave("a")
    shares.leave("b")
    clock.now = 101.0
    assert shares.present() == []
    assert shares.served == {}


def test_single_tenant_schedule_is_unchanged():
    plans = []
    for fair in (True, False):
        h = Harness(tenant_fairness=fair, max_num_batched_tokens=64, num_blocks=40)
        rng = random.Random(1)
        steps = []
        for i in range(60):
            if i < 30 and rng.random() < 0.5:
                h.add("solo", rng.randint(5, 150), max_tokens=rng.randint(1, 20))
            steps.append(h.step())
        plans.append(steps)
    assert plans[0] == plans[1]
    assert any(len(p) > 1 for p in plans[0])


@pytest.mark.parametrize("seed", range(12))
def test_three_tenants_on_a_tiny_pool_all_finish_with_blocks_intact(seed):
    # Prefills of tenants over their share are planned last; when blocks run out they must
    # still preempt (the newest idle sequence), or a pool full of their partial prompts stalls.
    h = Harness(max_num_batched_tokens=64, num_blocks=12)
    rng = random.Random(seed)
    for i in range(1500):
        h.clock.now += 0.05
        if i < 60 and rng.random() < 0.6:
            h.add(rng.choice(["calm", "flood", "third"]), rng.randint(5, 150), rng.randint(1, 40))
        h.step()  # checks block-pool integrity
        if not h.sched.has_work() and i >= 60:
            break
    assert not h.sched.has_work()
    assert h.sched.stats.preemptions > 0


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("priority", [False, True])
def test_fair_scheduling_never_changes_greedy_output(tiny_model_dir, priority):
    rng = random.Random(3)
    prompts = [[rng.randrange(5, 400) for _ in range(rng.randint(5, 200))] for _ in range(10)]
    outputs = []
    for fair in (True, False):
        llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=48,
                  max_num_batched_tokens=64, tenant_fairness=fair, tenant_prefill_chunk=16,
                  scheduling_policy="priority" if priority else "fcfs")  # fmt: skip
        engine = llm.engine
        for i, prompt in enumerate(prompts):
            salt = "flood" if i % 3 else "calm"
            engine.add(EngineRequest(f"r{i}", prompt, GREEDY, cache_salt=salt, priority=i % 2))
        got: dict[str, list[int]] = {}
        for _ in range(2000):
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
            engine.check_integrity()
        outputs.append(got)
    assert outputs[0] == outputs[1]
    assert len(outputs[0]) == len(prompts)


def test_the_head_is_the_least_served_tenant_whatever_its_name():
    h = Harness()
    for _ in range(4):
        h.add("aaa", 384, max_tokens=32)
    for _ in range(3):
        h.step()
    h.add("zzz", 64)
    plan = h.step()
    assert ("zzz4", 64) in plan
    assert prefill_tokens(plan, "aaa") == 0


def test_two_heavy_tenants_take_turns_and_stay_within_a_step_of_each_other():
    h = Harness()
    for _ in range(6):
        h.add("aaa", 300, max_tokens=4)
        h.add("bbb", 300, max_tokens=4)
    shares = h.sched.shares
    heads = []
    for _ in range(40):
        h.clock.now += 0.05
        plan = h.step()
        a, b = prefill_tokens(plan, "aaa"), prefill_tokens(plan, "bbb")
        if a or b:
            heads.append("a" if a > b else "b")
        assert abs(shares.served["aaa"] - shares.served["bbb"]) <= 2 * 256
    assert heads.count("a") >= 5 and heads.count("b") >= 5
