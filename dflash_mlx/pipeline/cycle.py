"""One request through a pipelined target: the cycle protocol.

The last rank runs the one decode protocol (``driver.Driver``, a batch of one, with the draft and
the sampler) on a ``PipelinedTarget``. Each pass of that loop sends a header and its tokens
to rank 0, which embeds them and runs its layers; every rank hands the header and its output
(hidden states, then the tapped layers' features so far) to the next; the last rank runs its
layers and the head. A header is ``[kind, trim, count, tapped, dtype, proposed]``: ``trim`` is how many
tokens of the previous pass every rank drops (the last rank's rollback after acceptance, told
with the next pass), so each rank's caches hold the committed tokens after every cycle. Rank 0
also reads the committed tokens from those headers: it is the rank that prints and serves;
``proposed`` is how many of a decode pass's tokens the draft proposed (its stats): on a GPU a
plain step is padded to two rows (``decoder.batch_min_rows``), and the padding is not a draft.
"""

from __future__ import annotations

from typing import Callable, Iterator, List, Optional, Sequence

import mlx.core as mx

from ..cache import restore, rollback, snapshot
from ..records import Cancelled, Commit
from .link import Link, PeerLost, is_transport_error
from .stages import Stage

PREFILL, STEP, VERIFY, STOP, ABORT, SHUTDOWN = 1, 2, 3, 4, 5, 6
HEADER = 6
DTYPES = [mx.float32, mx.float16, mx.bfloat16]


class Aborted(Exception):
    """Rank 0 ended the request (its consumer stopped reading, or the request was cancelled)."""


class Upstream:
    """The last rank's stand-in, in its cache list, for the caches of the ranks before it: it counts
    their tokens, and a trim (rollback, restore) is passed on to them with the next pass."""

    def __init__(self):
        self.offset = 0
        self.pending = 0

    @property
    def arrays(self) -> list:
        return []

    def trim(self, n: int) -> int:
        self.offset -= n
        self.pending += n
        return n

    def take(self) -> int:
        n, self.pending = self.pending, 0
        return n


def _header(kind: int, trim: int = 0, count: int = 0, tapped: bool = False, dtype=mx.float32,
            proposed: int = 0) -> List[int]:
    return [kind, trim, count, int(tapped), DTYPES.index(dtype), proposed]


class Pipeline:
    """This rank's part of a pipelined target: its stage's layers and caches, and its links."""

    def __init__(self, link: Link, model, stage: Stage, taps: Sequence[int], draft_block_size: Optional[int] = None,
                 draft_kind: Optional[str] = None):
        self.link, self.model, self.stage = link, model, stage
        self.taps = list(taps)
        # What rank 0 reports and checks block sizes against (the draft itself is on the last rank).
        self.draft_block_size, self.draft_kind = draft_block_size, draft_kind
        ordered = sorted(self.taps)
        self._taps_before = sum(t < stage.start for t in ordered)
        self._local_taps = [t - stage.start for t in ordered if stage.start <= t < stage.end]
        self._order = [ordered.index(t) for t in self.taps]  # arrival order -> the draft's order
        self.hidden_size = model.args.hidden_size
        self.cache: Optional[list] = None  # this rank's caches of the current (or last) request
        self._last = (0, 0, None)  # the previous pass: kind, count, snapshot before it

    @property
    def rank(self) -> int:
        return self.link.rank

    @property
    def drives(self) -> bool:
        """Rank 0 takes requests and prints or serves the answers."""
        return self.link.rank == 0

    def describe(self, draft=None) -> str:
        """One line for the logs: this rank's layers and the memory its weights take."""
        from mlx.utils import tree_flatten

        held = [self.model] + ([draft] if draft is not None else [])
        size = sum(v.nbytes for m in held for _, v in tree_flatten(m.parameters()))
        size_text = f"{size / 1e9:.2f} GB" if size >= 1e8 else f"{size / 1e6:.1f} MB"
        stage, layers = self.stage, self.model.args.num_hidden_layers
        parts = (["the embedding"] if stage.embedding else []) + (["the head"] if stage.last else [])
        parts += ["the draft"] if draft is not None else []
        return (f"rank {stage.rank} of {stage.world}: layers {stage.start}-{stage.end - 1} of {layers}"
                f"{' with ' + ', '.join(parts) if parts else ''}, {size_text} of weights")

    # -- every rank -------------------------------------------------------------------------

    def run(self, x: mx.array, cache: list, tapped: bool, record_tape: bool):
        """This stage on its input (token ids on rank 0, else the previous stage's output): the
        hidden states and the tapped features so far, in layer order."""
        if self.stage.first:
            h, carried = self.model.embed_tokens(x), []
        else:
            h = x[..., : self.hidden_size]
            carried = [x[..., self.hidden_size :]] if tapped and self._taps_before else []
        h, outputs = self.model.run_layers(h, cache, self._local_taps if tapped else (), record_tape)
        return h, carried + [outputs[i] for i in self._local_taps] if tapped else []

    def width_in(self, tapped: bool) -> int:
        """Channels of this stage's input: hidden states, and the features tapped before it."""
        return self.hidden_size * (1 + (self._taps_before if tapped else 0))

    def in_draft_order(self, features: List[mx.array]) -> mx.array:
        """The tapped features (they arrive in layer order) concatenated as the draft lists its taps."""
        features = mx.concatenate(features, axis=-1)
        if self._order == sorted(self._order):
            return features
        chunks = mx.split(features, len(self.taps), axis=-1)
        return mx.concatenate([chunks[i] for i in self._order], axis=-1)

    def _pass(self, kind: int, x: mx.array, tapped: bool) -> mx.array:
        """A follower's pass (rank 0, middle ranks): remembered so that the next header can undo it."""
        self._last = (kind, x.shape[1], snapshot(self.cache))
        h, features = self.run(x, self.cache, tapped, kind == VERIFY)
        return mx.concatenate([h, *features], axis=-1) if features else h

    def _drop(self, trim: int) -> None:
        """Undo the last ``trim`` tokens of the previous pass in this rank's caches."""
        kind, count, undo = self._last
        if trim == 0:
            return
        if trim == count:
            restore(self.cache, undo)
        elif kind == VERIFY and 0 < trim < count:
            rollback(self.cache, fed=count, kept=count - trim)
        else:
            raise RuntimeError(f"pipeline protocol: trim {trim} after a pass of {count} tokens (kind {kind})")

    def _forward(self, header: List[int], out: mx.array) -> None:
        link = self.link
        link.send_ints(header, link.next)
        link.wait(link.send(out, link.next))

    # -- rank 0 ------------------------------------------------------------------------------

    def drive(self, request: dict, cancelled: Optional[Callable[[], bool]] = None) -> Iterator[Commit]:
        """Send a request (prompt ids and settings) to the last rank, run rank 0's stage of every
        pass, and yield the committed tokens as ``Commit`` records (without log-probs: they stay
        on the last rank). Closing the stream tells the other ranks to stop."""
        link, last = self.link, self.link.size - 1
        link.watchdog.beat()  # from here on the other ranks must answer
        link.send_json(request, last)
        self.cache = self.model.make_cache()
        previous = None  # the last decode pass: its count and tokens
        answered, finished = True, False
        try:
            while True:
                kind, trim, count, tapped, _, proposed = link.ints(last, HEADER)
                answered = False
                tokens = link.ints(last, count) if count else []
                link.watchdog.beat()
                self._drop(trim)
                commit = None
                if kind in (STEP, VERIFY, STOP):
                    commit = _commit(previous, trim, tokens[0])
                    previous = (count, tokens, proposed)
                if kind == STOP:
                    link.send_ints(_header(STOP, trim), link.next)
                    answered = finished = True
                    yield commit
                    return
                out = self._pass(kind, mx.array(tokens, dtype=mx.int32)[None], bool(tapped))
                link.send_ints(_header(kind, trim, count, tapped, out.dtype), link.next)
                mx.async_eval(link.send(out, link.next))  # runs while the consumer reads the commit
                answered = True
                if kind == PREFILL and cancelled is not None and cancelled():
                    raise Cancelled
                if commit is not None:
                    yield commit
        except PeerLost:
            finished = True  # nobody to tell
            raise
        except RuntimeError as e:
            if is_transport_error(e):
                finished = True
                raise link.lost(e) from e
            raise
        finally:
            if not finished:
                self._abort(answered)  # still watched: a rank that stopped answering ends this too
            link.watchdog.rest()

    def _abort(self, answered: bool) -> None:
        """End the request early: answer the last rank's next header (or the one just received)
        with ABORT, or pass on its STOP if it finished meanwhile."""
        link, last = self.link, self.link.size - 1
        if answered:
            kind, trim, count, _, _, _ = link.ints(last, HEADER)
            if count:
                link.ints(last, count)
            if kind == STOP:
                link.send_ints(_header(STOP, trim), link.next)
                return
        link.send_ints(_header(ABORT), link.next)

    def shutdown(self) -> None:
        """Tell every other rank to exit (``serve_forever`` returns); waits for the ring to close."""
        link = self.link
        link.watchdog.beat()
        try:
            link.send_json({"shutdown": True}, link.size - 1)
            link.ints(link.size - 1, HEADER)
            link.send_ints(_header(SHUTDOWN), link.next)
        finally:
            link.watchdog.rest()

    # -- the other ranks ---------------------------------------------------------------------

    def take_part(self, run: Callable[[dict, "PipelinedTarget"], Iterator[Commit]]) -> bool:
        """Serve one request on a rank other than 0; False when rank 0 shut the pipeline down.
        ``run(request, target)`` makes the last rank's decode loop."""
        try:
            return self._last_rank(run) if self.stage.last else self._middle_rank()
        except RuntimeError as e:
            if is_transport_error(e):
                raise self.link.lost(e) from e
            raise
        finally:
            self.link.watchdog.rest()

    def serve_forever(self, run) -> None:
        while self.take_part(run):
            pass

    def _middle_rank(self) -> bool:
        link = self.link
        kind, trim, count, tapped, dtype, _ = link.ints(link.prev, HEADER)  # as long as the next request takes
        self.cache = self.model.make_cache()
        while True:
            link.watchdog.beat()
            self._drop(trim)
            if kind in (STOP, ABORT, SHUTDOWN):
                link.send_ints(_header(kind, trim), link.next)
                return kind != SHUTDOWN
            x = link.recv((1, count, self.width_in(bool(tapped))), DTYPES[dtype], link.prev)
            out = self._pass(kind, x, bool(tapped))
            self._forward(_header(kind, trim, count, tapped, out.dtype), out)
            kind, trim, count, tapped, dtype, _ = link.ints(link.prev, HEADER)

    def _last_rank(self, run) -> bool:
        link = self.link
        request = link.recv_json(0)  # as long as the next request takes
        if request.get("shutdown"):
            link.send_ints(_header(SHUTDOWN), 0)
            link.ints(link.prev, HEADER)
            return False
        link.watchdog.beat()
        target = PipelinedTarget(self, len(request["prompt"]))
        final = None
        try:
            for final in run(request, target):
                pass
        except Aborted:
            return True
        link.send_ints(_header(STOP, target.upstream.take(), 1), 0)
        link.send_ints([final.tokens[-1]], 0)
        link.ints(link.prev, HEADER)  # the STOP, back around the ring: every rank is done
        return True


def _commit(previous, trim: int, next_token: int) -> Commit:
    """What the last decode pass committed, as rank 0 reads it from the next header: the accepted
    part of what it fed (after the first token) and the next pass's first token; drafted: what
    the draft proposed (``proposed``), not the padding after it."""
    if previous is None:
        return Commit([next_token], None)
    count, tokens, proposed = previous
    kept = count - trim
    return Commit(tokens[1:kept] + [next_token], None, drafted=proposed, accepted=kept - 1)


class PipelinedTarget:
    """The target as the last rank's decode loop sees it: ``forward`` sends the pass to rank 0,
    receives the previous stage's output, and runs the last stage and the head."""

    def __init__(self, pipeline: Pipeline, prompt_tokens: int):
        self.pipeline = pipeline
        self.args = pipeline.model.args
        self.upstream = Upstream()
        self._prefill_left = prompt_tokens

    def make_cache(self) -> list:
        self.pipeline.cache = self.pipeline.model.make_cache()
        return [self.upstream] + self.pipeline.cache

    def forward(self, inputs: mx.array, cache: list, taps: Sequence[int] = (), record_tape: bool = False,
                last_only: bool = False, proposed: Sequence[int] = ()):
        pipeline, link = self.pipeline, self.pipeline.link
        tapped = bool(taps)
        if tapped and list(taps) != pipeline.taps:
            raise ValueError(f"taps {list(taps)} differ from the pipeline's {pipeline.taps}")
        count = inputs.shape[1]
        kind = PREFILL if self._prefill_left > 0 else VERIFY if record_tape else STEP
        if kind == PREFILL:
            self._prefill_left -= count
        upstream, own = cache[0], cache[1:]
        drafted = proposed[0] if proposed else count - 1  # the decoder says; else every row after the first
        link.send_ints(_header(kind, upstream.take(), count, tapped, proposed=drafted), 0)
        link.wait(link.send(inputs.reshape(-1).astype(mx.int32), 0))
        link.watchdog.beat()
        reply, _, _, _, dtype, _ = link.ints(link.prev, HEADER)
        if reply == ABORT:
            raise Aborted
        x = link.recv((1, count, pipeline.width_in(tapped)), DTYPES[dtype], link.prev)
        upstream.offset += count
        h, features = pipeline.run(x, own, tapped, record_tape)
        logits = pipeline.model.logits(h, last_only)
        if not tapped:
            return logits, None
        return logits, pipeline.in_draft_order(features)
