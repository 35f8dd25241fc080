"""Run-assigned work as the default for runs anyone may join, tickets a worker drops, and the online filter's
redraws along a ticket (rlfleet/fleet/assignment.py), through a real gate on a real redis-server.

A worker that draws its own seeds can grind them: sample many groups and send those it likes, each of
which passes the seed replay. Assigning the work closes that, and a worker that instead drops the tickets
whose groups it does not like is banned once its dropped tickets pass the run's allowance.
"""

from __future__ import annotations

from rlfleet.config import parse_bundle
from rlfleet.engines.torch_engine import TorchEngine
from rlfleet.fleet.assignment import assigned_work, issue_ticket
from rlfleet.fleet.prompt_filter import prompt_key
from rlfleet.fleet.reputation import ban_record, one_worker_stats
from rlfleet.tasks.chat import encode_prompt
from tests.toploc import attacks
from tests.toploc.test_gate import gate_config, gate_system, rejections, run_gate, verified_ids

SAMPLING = "{groupSize: 4, maxTokens: 6}"  # no assignment: the run's admission decides it
OPEN = "{admission: {mode: open}}"


def ticketed(engine: TorchEngine, spec, worker: str, ticket: int | None, draw: int = 0):
    """The group an honest worker makes for draw `draw` of `ticket` (task and seed assigned by the run)."""
    task_id, seed = assigned_work(attacks.make_run_task(spec), spec.task.seed, worker, ticket or 0, draw)
    group = attacks.honest(engine, spec, int(task_id.rsplit("-", 1)[1]), worker=worker)
    group.sampling.seed = seed
    group = attacks.resampled(engine, group, spec)  # drawn with the assigned seed
    group.ticket, group.ticket_draw = ticket, draw
    return group


def test_a_run_anyone_may_join_assigns_the_work_unless_it_says_otherwise(tmp_path):
    def assignment(ingest: str | None, sampling: str = SAMPLING) -> str:
        sections = {"ingest": ingest} if ingest else {}
        run = parse_bundle(gate_config(tmp_path, tmp_path / "store", sampling, "{}", **sections)).run
        return run.spec.sampling.assignment

    assert assignment(None) == "worker"  # only the run's own (token-holding) workers
    assert assignment(OPEN) == "run"
    assert assignment("{admission: {mode: invite, invitesFile: codes.yaml}}") == "run"
    assert assignment(OPEN, "{groupSize: 4, maxTokens: 6, assignment: worker}") == "worker"  # said explicitly


def test_with_open_admission_a_seed_grinder_gets_no_group_accepted(tmp_path, redis_url):
    """The grinder samples each task with seeds of its own and sends the group it likes best (the most correct),
    with or without a ticket it was issued; only the honest worker's ticketed group is accepted."""
    with gate_system(tmp_path, redis_url, sampling=SAMPLING, ingest=OPEN) as (ctx, policy, origin_url, tmp):
        spec, r, keys = ctx.bundle.run.spec, ctx.redis, ctx.keys
        assert spec.sampling.assignment == "run"
        engine = TorchEngine(policy, 0)
        ground = []
        for index in (3, 4, 5):
            tries = []
            for seed in range(5):
                g = attacks.honest(engine, spec, index, worker="w-grinder")
                g.sampling.seed = 1000 * index + seed
                tries.append(attacks.resampled(engine, g, spec))
            ground.append(max(tries, key=lambda g: sum(s.reward for s in g.samples)))
        ground[1].ticket = issue_ticket(r, keys, "w-grinder")  # an issued ticket does not license its own seeds
        honest = ticketed(engine, spec, "w-honest", issue_ticket(r, keys, "w-honest"))
        for g in (*ground, honest):
            r.xadd(keys.rollouts, g.encode())
        run_gate(ctx, origin_url, tmp / "cache", expected=4)
        assert verified_ids(ctx) == [honest.rollout_id]
        assert {rejections(ctx)[g.rollout_id] for g in ground} == {"assignment"}


def test_a_worker_that_drops_its_tickets_is_banned_and_one_that_uses_them_is_not(tmp_path, redis_url):
    verifier = "{ban: {droppedTicketAllowance: 4, maxDroppedTicketShare: 0.25}}"
    with gate_system(tmp_path, redis_url, sampling=SAMPLING, verifier=verifier, ingest=OPEN) as (
        ctx,
        policy,
        origin_url,
        tmp,
    ):
        spec, r, keys = ctx.bundle.run.spec, ctx.redis, ctx.keys
        engine = TorchEngine(policy, 0)
        # The dropper took 12 tickets and sends the groups of the last two (those it liked): at the first, 10 of the
        # 11 tickets reached unused > 4 + 0.25 x 11.
        dropper = [issue_ticket(r, keys, "w-dropper") for _ in range(12)]
        kept = [ticketed(engine, spec, "w-dropper", k) for k in dropper[10:12]]
        # The honest worker took 16 and sends 5 (the rest still generating or in the inbox): none before its latest
        # accepted ticket unused, although 11 of its 16 are (the old rule's count: over 4 + 0.25 x 16).
        used = [ticketed(engine, spec, "w-honest", issue_ticket(r, keys, "w-honest")) for _ in range(5)]
        for _ in range(11):
            issue_ticket(r, keys, "w-honest")
        for g in (*kept, *used):
            r.xadd(keys.rollouts, g.encode())
        run_gate(ctx, origin_url, tmp / "cache", expected=7)

        assert verified_ids(ctx) == [kept[0].rollout_id, *(g.rollout_id for g in used)]
        assert rejections(ctx) == {kept[1].rollout_id: "banned"}  # banned with its first accepted group
        record = ban_record(r, keys, "w-dropper")
        assert record is not None and (record["rule"], record["reason"]) == ("droppedTickets", "assignment")
        assert ban_record(r, keys, "w-honest") is None
        counters = one_worker_stats(r, keys, "w-honest")["counters"]
        assert counters["tickets_used"] == 5 and counters["tickets_reached"] == 5


def test_a_filtered_run_redraws_along_the_ticket_and_the_gate_checks_the_skipped_draws(tmp_path, redis_url):
    """With the online filter a worker takes the first draw of its ticket whose prompt is not retired, spending
    no ticket on a redraw; a draw past one whose prompt is not retired (a choice among draws) is rejected."""
    sampling = "{groupSize: 4, maxTokens: 6, assignment: run, onlineFilter: {maxRedraws: 3}}"
    with gate_system(tmp_path, redis_url, sampling=sampling) as (ctx, policy, origin_url, tmp):
        spec, r, keys = ctx.bundle.run.spec, ctx.redis, ctx.keys
        engine = TorchEngine(policy, 0)
        task = attacks.make_run_task(spec)

        def retire(worker: str, ticket: int, draw: int) -> None:
            task_id, _ = assigned_work(task, spec.task.seed, worker, ticket, draw)
            r.rpush(keys.retired_prompts, prompt_key(encode_prompt(engine.tokenizer, task.problem(task_id))))

        first, second, third = (issue_ticket(r, keys, "w-a") for _ in range(3))
        retire("w-a", first, 0)
        redrawn = ticketed(engine, spec, "w-a", first, draw=1)  # its draw 0 is retired: draw 1 is its work
        chosen = ticketed(engine, spec, "w-a", second, draw=1)  # its draw 0 is not retired
        past = ticketed(engine, spec, "w-a", third, draw=3)  # a ticket has draws 0, 1 and 2 (maxRedraws 3)
        for g in (redrawn, chosen, past):
            r.xadd(keys.rollouts, g.encode())
        run_gate(ctx, origin_url, tmp / "cache", expected=3)
        assert verified_ids(ctx) == [redrawn.rollout_id]
        assert rejections(ctx) == {chosen.rollout_id: "assignment", past.rollout_id: "assignment"}
