"""`auto`'s choices replayed offline: a controller change judged in seconds, not in bench runs.

    python examples/auto_replay.py record --context 4k --out records.json [--model demo] [--suite code ...]
    python examples/auto_replay.py replay records.json [--costs 4.5,7.98,9.13,9.7] [--shadow 2.1]
                                          [--hand-off 0.5,0.012] [--repeats 3] [--seeds 10] [--verbose]

`record` decodes the bench's prompts (`bench --context`'s file context before each, greedy, its
token budget, stopping where the bench stops) with plain steps that each also draft ``cap - 1``
tokens unverified (a shadow every step), and keeps, for every position of every answer, how many
of the draft's guesses there the target takes. Greedy verification accepts exactly the longest
prefix of the guesses that equals the target's own tokens, so a cycle of any size at any position
accepts ``min(taken, size - 1)``: the whole run of any controller over these answers follows from
the record (the draft sees the same committed tokens whatever drafted them; only the last bits of
the features the target hands it differ between a plain step and a verify row, which
`tests/test_examples.py` checks does not change a fixed-size run's accepted lengths).

`replay` runs ``block_policy.AutoBlock`` (this checkout's, or with ``--code DIR`` the one in the
checkout at DIR, a worktree of another commit) over the records in the bench's order (each prompt
``--repeats`` times, suites in the order recorded, one ``BlockStats`` for all, after the bench's
64-token `auto` warm-up), feeding it
what the decode loop does (block, accepted, committed tokens, a shadow's proposals, the plain steps
handed off, the context). A cycle's seconds come from a cost model, not a clock: ``--costs`` (ms
per cycle of size 1..cap), plus ``--shadow`` ms for a shadow's draft pass and ``A + B*n`` ms
(``--hand-off A,B``) when a draft pass hands off ``n`` plain steps' features, each time a uniform
``--noise``. The defaults are the 2-core CI machine's at 4k tokens: the controller's own cycle
costs in a bench run, a shadow from a decode of plain steps against the same with a shadow every
step, the hand-off a rough fit to cycles that handed off 3 to 50 plain steps' features. It
prints, per suite, the target alone's time over the replayed one (medians over ``--seeds`` noise
seeds): what `bench` reports as the speedup, less the noise of a real run and the decode loop's
own overhead (a plain cycle costs 1.3% more than the target alone's step, docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WARM_UP = "warm up"  # bench.warm_up's auto run: 64 tokens of this prompt, no context, before the suites


class ShadowEveryStep:
    """A chooser that never drafts a block and shadows every plain step: the record's source.
    ``shadows``: each step's unverified guesses, in order."""

    def __init__(self, ahead: int):
        self.ahead, self.shadows = ahead, []

    def choose(self) -> int:
        return 1

    def shadow_tokens(self) -> int:
        return self.ahead

    def observe(self, block, accepted, seconds, committed=(), proposals=(), handed_off=0, context=None) -> None:
        self.shadows.append(list(proposals))


def taken_per_position(answer, shadows):
    """``taken[n - 1]``: how many of the guesses drafted with ``n`` tokens of the answer committed
    (the shadow of the plain step that commits ``answer[n]``) equal ``answer[n:]``, in order."""
    taken = []
    for n, proposals in enumerate(shadows, start=1):
        k = 0
        while k < len(proposals) and n + k < len(answer) and proposals[k] == answer[n + k]:
            k += 1
        taken.append(k)
    return taken


def record_answer(model, tokenizer, text: str, max_tokens: int):
    """The answer to ``text`` (a chat message, as the bench sends it), as the bench's greedy run
    ends it, with ``taken_per_position`` and the context at its first token."""
    from dflash_mlx.api import encode_prompt
    from dflash_mlx.sampling import Sampler
    from dflash_mlx.speculative import speculative

    prompt = encode_prompt(tokenizer, [{"role": "user", "content": text}])
    chooser = ShadowEveryStep(model.draft.block_size - 1)
    answer = []
    for commit in speculative(model.target, model.draft, prompt, Sampler(0.0), chooser, draft_window=model.draft_window,
                              max_tokens=max_tokens, stop_tokens=set(tokenizer.eos_token_ids)):
        answer += commit.tokens
    return {"answer": answer, "taken": taken_per_position(answer, chooser.shadows[: len(answer) - 1]),
            "context": int(prompt.size),
            "max_tokens": max_tokens}


def record(args) -> None:
    from dflash_mlx import bench, load

    model, tokenizer = load(args.model, draft=args.draft)
    context = args.context
    prefix = bench.file_context(tokenizer, context)
    out = {"cap": model.draft.block_size, "context": context, "max_tokens": args.max_tokens,
           "warm_up": record_answer(model, tokenizer, WARM_UP, 64), "suites": {}}
    for suite in args.suite:
        out["suites"][suite] = [record_answer(model, tokenizer, bench.with_context(p, prefix), args.max_tokens)
                                for p in bench.SUITES[suite]]
        mean = statistics.mean(t for a in out["suites"][suite] for t in a["taken"])
        print(f"{suite}: {len(out['suites'][suite])} answers, "
              f"{[len(a['answer']) for a in out['suites'][suite]]} tokens, mean guesses taken {mean:.2f}")
    Path(args.out).write_text(json.dumps(out))
    print(f"wrote {args.out}")


class CostModel:
    """A cycle's seconds from its size, whether it shadowed and how many plain steps it handed off."""

    def __init__(self, costs, shadow, hand_off, noise, rng):
        self.costs, self.shadow, self.hand_off, self.noise, self.rng = costs, shadow, hand_off, noise, rng

    def seconds(self, block: int, shadowed: bool, handed_off: int) -> float:
        ms = self.costs[min(block, len(self.costs)) - 1] + (self.shadow if shadowed else 0.0)
        if handed_off:
            ms += self.hand_off[0] + self.hand_off[1] * handed_off
        return 1e-3 * ms * (1 + self.noise * self.rng.uniform(-1, 1))


def replay_answer(policy, stats, cap: int, answer, cost: CostModel, log=None) -> float:
    """One request through a fresh ``AutoBlock`` on ``stats``: the replayed seconds of its cycles.
    As the decode loop: a block no longer than the tokens the budget leaves; the context is the
    target cache's (the prompt and every committed token but the last, the next input)."""
    tokens, taken, start = answer["answer"], answer["taken"], answer["context"]
    controller, n, pending, seconds = policy.AutoBlock(stats, cap), 1, 0, 0.0  # n: tokens committed
    while n < len(tokens):
        block = min(controller.choose(), answer["max_tokens"] - n)
        ahead = controller.shadow_tokens() if block == 1 else 0
        drafts = block > 1 or ahead > 0
        handed_off, pending = (pending, 0) if drafts else (0, pending)
        accepted = min(taken[n - 1], block - 1)
        proposals = []
        if ahead:
            hits = min(taken[n - 1], ahead)
            proposals = tokens[n : n + hits] + [-1] * (ahead - hits)
        spent = cost.seconds(block, ahead > 0, handed_off)
        committed = tokens[n : n + accepted + 1]
        n += len(committed)
        pending += block == 1
        controller.observe(block, accepted, spent, committed, proposals, handed_off, start + n - 1)
        seconds += spent
        if log is not None:
            log.append(f"{block}{'s' if ahead else ''}/{accepted}")
    return seconds


def compact(log) -> str:
    runs = []
    for item in log:
        if runs and runs[-1][0] == item:
            runs[-1][1] += 1
        else:
            runs.append([item, 1])
    return " ".join(f"{item}x{count}" if count > 1 else item for item, count in runs)


def replay(args) -> None:
    if args.code:
        sys.path.insert(0, str(Path(args.code).resolve()))
    import dflash_mlx.block_policy as policy

    print(f"replaying {policy.__file__}")
    data = json.loads(Path(args.records).read_text())
    cap = data["cap"]
    costs, hand_off = args.costs, args.hand_off
    speedups = {suite: [] for suite in data["suites"]}
    for seed in range(args.seeds):
        cost = CostModel(costs, args.shadow, hand_off, args.noise, random.Random(seed))
        stats = policy.BlockStats()  # as a fresh load's
        replay_answer(policy, stats, cap, data["warm_up"], cost)
        for suite, answers in data["suites"].items():
            alone = replayed = 0.0
            for index, answer in enumerate(answers):
                for repeat in range(args.repeats):
                    log = [] if args.verbose and seed == 0 else None
                    seconds = replay_answer(policy, stats, cap, answer, cost, log)
                    plain = 1e-3 * costs[0] * (len(answer["answer"]) - 1)
                    alone, replayed = alone + plain, replayed + seconds
                    if log is not None:
                        print(f"{suite} #{index + 1} run {repeat + 1}: {plain / seconds:.3f}x  {compact(log)}")
            speedups[suite].append(alone / replayed)
    print(f"cost model (ms): cycles {costs}, shadow +{args.shadow}, hand-off {hand_off[0]} + {hand_off[1]}/step, "
          f"noise {args.noise:.0%}; {args.seeds} seeds")
    for suite, values in speedups.items():
        print(f"{suite}: replayed speedup {statistics.median(values):.3f}x (seeds: {min(values):.3f}-{max(values):.3f})")


def floats(text: str):
    """``"4.5,7.98"`` -> ``[4.5, 7.98]``: positive milliseconds."""
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated milliseconds, e.g. 4.5,7.98") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: milliseconds cannot be negative")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record", help="decode the bench's prompts and keep what the draft guessed right where")
    rec.add_argument("--model", default="demo", help="a target with a draft: demo, or a target directory (with --draft)")
    rec.add_argument("--draft", default=None, help="the draft's directory, with a target directory as --model")
    rec.add_argument("--context", default="4k", help="tokens of file context before each prompt, as bench --context")
    rec.add_argument("--suite", action="append", choices=["code", "prose", "edit"],
                     help="code, prose, edit (repeatable; default: all three, in that order)")
    rec.add_argument("--max-tokens", type=int, default=256, help="the answer's budget in tokens (the bench's default)")
    rec.add_argument("--out", required=True, help="where to write the record (JSON), once every answer is in")
    rep = commands.add_parser("replay", help="run AutoBlock over a record with a cost model")
    rep.add_argument("records")
    rep.add_argument("--costs", type=floats, default="4.5,7.98,9.13,9.7", help="ms per cycle of size 1..cap (the last repeats)")
    rep.add_argument("--shadow", type=float, default=2.1, help="ms a shadow's draft pass adds to a plain step")
    rep.add_argument("--hand-off", type=floats, default="0.5,0.012", help="A,B: a draft pass that hands off n plain steps adds A + B*n ms")
    rep.add_argument("--noise", type=float, default=0.04, help="each cycle's time times 1 +- this, uniform")
    rep.add_argument("--repeats", type=int, default=3, help="runs per prompt, as bench --repeats")
    rep.add_argument("--seeds", type=int, default=10, help="noise seeds; medians are printed")
    rep.add_argument("--code", default=None, help="a checkout (a worktree of another commit) whose block_policy to replay")
    rep.add_argument("--verbose", action="store_true", help="every request's choices (first seed): size[s: shadow]/accepted")
    args = parser.parse_args()
    if args.command == "record":
        from dflash_mlx.bench import parse_context_sizes

        args.suite = args.suite or ["code", "prose", "edit"]
        try:
            args.context = parse_context_sizes(args.context)[0]
        except ValueError as e:
            parser.error(f"--context: {e}")
        if args.max_tokens < 2:
            parser.error(f"--max-tokens {args.max_tokens}: an answer needs at least 2 tokens to replay a cycle")
        if not Path(args.out).resolve().parent.is_dir():
            parser.error(f"--out {args.out}: its folder does not exist")
        record(args)
    else:
        if len(args.hand_off) != 2:
            parser.error(f"--hand-off {args.hand_off}: expected two numbers, A,B")
        if not Path(args.records).is_file():
            parser.error(f"{args.records}: no such records file (write one with `record --out`)")
        replay(args)


if __name__ == "__main__":
    main()
