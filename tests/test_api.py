"""The mlx_lm-style API: load, generate, stream_generate, on a tiny pair in the real layouts."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import (
    GenerationResponse,
    Sampler,
    generate,
    load,
    stream_generate,
    tiny,
)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target_dir, draft_dir = tiny.write_pair(tmp_path_factory.mktemp("pair"))
    return load(str(target_dir), draft=str(draft_dir))


def test_speculative_text_equals_target_alone(pair):
    model, tokenizer = pair
    for prompt in ("def fibonacci(n):", "The quick brown fox"):
        alone = generate(model, tokenizer, prompt, max_tokens=40, use_draft=False)
        for block in (2, 8, 16):
            assert generate(model, tokenizer, prompt, max_tokens=40, block_tokens=block) == alone


def test_responses_carry_mlx_lm_fields_and_statistics(pair):
    model, tokenizer = pair
    responses = list(stream_generate(model, tokenizer, "class Stack:", max_tokens=30, block_tokens=4))
    assert len(responses) == 30 and all(isinstance(r, GenerationResponse) for r in responses)
    last = responses[-1]
    assert last.finish_reason == "length" and all(r.finish_reason is None for r in responses[:-1])
    assert [r.generation_tokens for r in responses] == list(range(1, 31))
    assert last.prompt_tokens == len(tokenizer.encode("class Stack:"))
    assert last.logprobs.shape == (tiny.target_config()["vocab_size"],)
    assert abs(mx.exp(last.logprobs).sum().item() - 1) < 1e-4
    # from_draft marks exactly the accepted drafted tokens.
    assert sum(r.from_draft for r in responses) <= last.accepted_tokens
    # Blocks of 4, but the last cycles draft no more than max_tokens leaves (random draft: 3, 2, 1).
    assert last.drafted_tokens == sum((b - 1) * n for b, n in last.block_histogram.items())
    assert sum(last.block_histogram.values()) == last.cycles and max(last.block_histogram) == 4
    assert last.tokens_per_cycle == pytest.approx(29 / last.cycles)
    assert 0 <= last.acceptance_rate <= 1
    assert "".join(r.text for r in responses) == generate(model, tokenizer, "class Stack:", max_tokens=30)


def test_from_draft_with_a_draft_that_is_always_right(pair):
    """Give the target's own continuation as the draft's proposals: every token but bonuses is drafted."""
    from tests.test_lossless import OracleDraft

    model, tokenizer = pair
    prompt = tokenizer.encode("def fibonacci(n):")
    alone = [r.token for r in stream_generate(model.target, tokenizer, prompt, max_tokens=40)]
    oracle = OracleDraft(prompt + alone, 4, schedule=[3])  # 3 = no corrupted slot
    oracle.mask_token_id = tiny.target_config()["vocab_size"] - 1
    from dflash_mlx.api import DFlashModel

    responses = list(stream_generate(DFlashModel(model.target, oracle), tokenizer, prompt, max_tokens=25, block_tokens=4))
    assert [r.token for r in responses] == alone[:25]
    # Token 0 comes from prefill; then each cycle commits 3 drafted tokens and 1 bonus.
    assert [r.from_draft for r in responses] == [False] + [True, True, True, False] * 6
    assert responses[-1].tokens_per_cycle == 4.0 and responses[-1].acceptance_rate == 1.0


def test_each_token_carries_the_targets_logprobs_at_its_own_position(pair):
    """Several tokens per cycle (an oracle draft, accepting 3, 1, 3, 0, 2 of 3 in turn): each
    token's logprobs equal the target alone's at the same position, not its cycle's first row.

    Tolerance 1e-4 (absolute, on log-probabilities down to about -11): the verify pass computes
    4 rows at once, so its sums run in another order than a decode step's (the CPU's matmul
    blocking, the chunked Gated DeltaNet recurrence); measured up to 1e-5, about ten float32
    ulps at that magnitude. Another position's distribution differs by more than 1."""
    from dflash_mlx.api import DFlashModel
    from tests.test_lossless import OracleDraft

    model, tokenizer = pair
    prompt = tokenizer.encode("def fibonacci(n):")
    alone = list(stream_generate(model.target, tokenizer, prompt, max_tokens=30))
    oracle = OracleDraft(prompt + [r.token for r in alone], 4, schedule=[3, 1, 3, 0, 2])
    oracle.mask_token_id = tiny.target_config()["vocab_size"] - 1
    responses = list(stream_generate(DFlashModel(model.target, oracle), tokenizer, prompt, max_tokens=30, block_tokens=4))
    assert [r.token for r in responses] == [r.token for r in alone] and len(alone) == 30
    assert responses[-1].accepted_tokens == 18 and responses[-1].cycles == 11  # 2.6 tokens per cycle
    for i, (got, want) in enumerate(zip(responses, alone)):
        np.testing.assert_allclose(np.array(got.logprobs), np.array(want.logprobs), rtol=0, atol=1e-4,
                                   err_msg=f"token {i}")


def test_prompt_forms(pair):
    model, tokenizer = pair
    text = "def fibonacci(n):"
    ids = tokenizer.encode(text)
    assert generate(model, tokenizer, text, max_tokens=8) == generate(model, tokenizer, ids, max_tokens=8)
    assert generate(model, tokenizer, mx.array(ids), max_tokens=8) == generate(model, tokenizer, ids, max_tokens=8)
    messages = [{"role": "user", "content": "hello"}]
    templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert generate(model, tokenizer, messages, max_tokens=8) == generate(model, tokenizer, list(templated), max_tokens=8)
    no_think = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert "<think>" in no_think
    with pytest.raises(TypeError, match="prompt must be"):
        generate(model, tokenizer, [1.5, 2.5])


def test_stop_strings_and_eos(pair):
    model, tokenizer = pair
    full = list(stream_generate(model, tokenizer, "The quick", max_tokens=30))
    text = "".join(r.text for r in full)
    stop = text[10:14]
    stopped = list(stream_generate(model, tokenizer, "The quick", max_tokens=30, stop=[stop], block_tokens=8))
    assert "".join(r.text for r in stopped) == text[: text.index(stop)]
    assert stopped[-1].finish_reason == "stop"
    eos = full[6].token
    own = set(tokenizer.eos_token_ids)  # the shared tokenizer's EOS, for the tests after this one
    tokenizer.eos_token_ids = {eos}
    try:
        ended = list(stream_generate(model, tokenizer, "The quick", max_tokens=30, block_tokens=8))
    finally:
        tokenizer.eos_token_ids = own
    assert tokenizer.eos_token_ids == own and own
    assert [r.token for r in ended] == [r.token for r in full][: [r.token for r in full].index(eos) + 1]
    assert ended[-1].finish_reason == "stop"


def test_auto_is_the_default_and_lossless(pair, monkeypatch):
    model, tokenizer = pair
    for prompt in ("def fibonacci(n):", "The quick brown fox"):
        alone = generate(model, tokenizer, prompt, max_tokens=40, use_draft=False)
        assert generate(model, tokenizer, prompt, max_tokens=40) == alone
        for setting in ("auto", "auto:4", "auto:1", 1):
            assert generate(model, tokenizer, prompt, max_tokens=40, block_tokens=setting) == alone
    responses = list(stream_generate(model, tokenizer, "class Stack:", max_tokens=40, block_tokens="auto:4"))
    last = responses[-1]
    assert sum(last.block_histogram.values()) == last.cycles and set(last.block_histogram) <= {1, 2, 3, 4}
    assert responses[0].block_tokens == 0 and all(1 <= r.block_tokens <= 4 for r in responses[1:])
    # The pair's cost statistics outlive the request: a second one starts from them.
    assert model.block_stats.costs.measured
    # Sampled requests never shadow (a shadow grades drafts by matching greedy tokens), and a
    # seeded sampled one drafts whole blocks, so that the seed reproduces it.
    from dflash_mlx import block_policy

    made = []  # can_shadow of every controller the requests build (recorded at construction: the
    real_init = block_policy.AutoBlock.__init__  # controller may never pick a plain step in 8 tokens)

    def recording(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        made.append(self.can_shadow)

    monkeypatch.setattr(block_policy.AutoBlock, "__init__", recording)
    generate(model, tokenizer, "def", max_tokens=8, temp=0.8)
    assert made and not any(made)
    made.clear()
    generate(model, tokenizer, "def", max_tokens=8, temp=0.8, seed=1)
    assert not made


def test_seeded_sampling_is_reproducible(pair):
    """Each request draws from its own generator: a seeded one neither uses nor advances MLX's
    global generator, and gives the same text after an unseeded request and other global draws."""
    model, tokenizer = pair
    mx.random.seed(0)
    following = mx.random.uniform(shape=(4,)).tolist()
    mx.random.seed(0)
    a = generate(model, tokenizer, "def", max_tokens=20, temp=0.9, top_p=0.95, seed=3)
    assert mx.random.uniform(shape=(4,)).tolist() == following, "a request drew from the global generator"
    generate(model, tokenizer, "def", max_tokens=20, temp=0.9, top_p=0.95)  # unseeded, in between
    mx.random.seed(11)
    b = generate(model, tokenizer, "def", max_tokens=20, sampler=Sampler(0.9, top_p=0.95), seed=3)
    assert a == b
    # ...and it does sample: other seeds give other texts, not the greedy one every time.
    others = {generate(model, tokenizer, "def", max_tokens=20, temp=0.9, top_p=0.95, seed=s) for s in (4, 5, 6)}
    greedy = generate(model, tokenizer, "def", max_tokens=20)
    assert len(others | {a}) > 1 and others != {greedy}


def test_bad_arguments(pair):
    model, tokenizer = pair
    with pytest.raises(ValueError, match="block_tokens '32': more than the draft's block size 16"):
        generate(model, tokenizer, "x", block_tokens=32)
    with pytest.raises(ValueError, match="block_tokens 'auto:x'"):
        generate(model, tokenizer, "x", block_tokens="auto:x")
    with pytest.raises(ValueError, match="block_tokens '4' needs a draft"):
        generate(model.target, tokenizer, "x", block_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        generate(model, tokenizer, "x", max_tokens=0)
    with pytest.raises(TypeError, match="dflash_mlx.Sampler"):
        generate(model, tokenizer, "x", sampler=lambda logits: mx.argmax(logits, -1))
    with pytest.raises(ValueError, match="empty"):
        generate(model, tokenizer, [])


def test_load_errors(tmp_path):
    from dflash_mlx.loading import CheckpointError

    with pytest.raises(CheckpointError, match="no checkpoint folder"):
        load(str(tmp_path / "missing"))
    target_dir, draft_dir = tiny.write_pair(tmp_path)
    with pytest.raises(ValueError, match="bad quantization"):
        load(str(target_dir), draft=str(draft_dir), draft_quant="w5:gs7")
    model, _ = load(str(target_dir), draft=str(draft_dir), draft_quant="w4:gs32")
    assert model.draft.fc.bits == 4


def test_a_request_sent_round_a_pipeline_decodes_on_the_last_rank_as_here(pair):
    """What rank 0 sends the last rank (``DecodeRequest.message``, through JSON) rebuilds a request
    that decodes the tokens the request decodes in one process: sampled with filters and a seed,
    drafted or not (the pipelined runs in test_pipeline.py check this end to end, slowly)."""
    import json

    from dflash_mlx.api import encode_prompt
    from dflash_mlx.runner import DecodeRequest, drive

    model, tokenizer = pair

    def tokens(request):
        return [t for c in drive(model, model.target, request).steps for t in c.tokens]

    ids = encode_prompt(tokenizer, "def fibonacci(n):")
    for use_draft, block in ((True, 4), (False, "auto")):
        sampler = Sampler(1.5, top_p=0.95, top_k=50, min_p=0.01)
        here = DecodeRequest(ids, 24, block, sampler.for_request(11), 11, use_draft, 64, set(tokenizer.eos_token_ids))
        sent = DecodeRequest.from_message(json.loads(json.dumps(here.message())))
        assert sent.sampler.settings() == sampler.settings()
        assert tokens(sent) == tokens(here)
