"""Predicted outputs: proposals read off a request's prediction, exact under greedy, counted, with
or without the engine's own speculation, leak-free."""

import random

import pytest

from vivace import LLM, SamplingParams
from vivace.engine.prediction import PREDICTION_MAX_K, Prediction, prediction_adaptive_k

GREEDY = dict(temperature=0, max_tokens=40, ignore_eos=True)


def propose(prediction: Prediction, output: list[int], room: int = 99) -> list[int]:
    return prediction.propose(output[-3:], len(output), prediction_adaptive_k(), room)


def test_alignment_follows_the_output_through_edits():
    prediction = Prediction(list(range(100, 140)))
    assert propose(prediction, []) == list(range(100, 100 + PREDICTION_MAX_K))  # nothing out yet: from the start
    assert propose(prediction, [100, 101, 102])[:3] == [103, 104, 105]
    # Tokens 103..109 deleted: the output's tail is found after the alignment.
    assert propose(prediction, [100, 101, 102, 110, 111])[:2] == [112, 113]
    # New tokens: nowhere in the prediction, no proposal; once the output is back on it, it goes on.
    assert propose(prediction, [100, 101, 102, 110, 111, 7, 8]) == []
    assert propose(prediction, [100, 101, 102, 110, 111, 7, 8, 112, 113, 114])[:2] == [115, 116]
    # Back to an earlier place (text repeated): the latest match before the alignment.
    assert propose(prediction, [100, 101, 102, 110, 111, 7, 8, 112, 113, 114, 101, 102, 103])[:2] == [104, 105]
    assert propose(prediction, [1, 2, 139]) == []  # at the prediction's end: nothing left
    assert propose(prediction, [100, 101], room=1) == [102]


def test_a_repeated_phrase_is_followed_where_the_alignment_is():
    phrase = [5, 6, 7]
    prediction = Prediction(phrase + [1] + phrase + [2] + phrase + [3])
    output = phrase + [1] + phrase
    assert propose(prediction, output)[0] == 2  # not the first ``5 6 7``, which is behind
    assert propose(prediction, output + [2] + phrase)[0] == 3


def test_the_length_doubles_while_proposals_land_and_drops_on_a_miss():
    adaptive = prediction_adaptive_k()
    prediction = Prediction(list(range(200)))
    lengths = []
    k = PREDICTION_MAX_K
    for proposed, accepted in ((k, k), (k, 3), (3, 3), (6, 6), (12, 12), (k, 0)):
        assert adaptive.next_k(prediction) == proposed
        adaptive.update(prediction, proposed, accepted)
        lengths.append(prediction.spec_k)
    assert lengths == [k, 3, 6, 12, k, k // 2]


@pytest.fixture(scope="module")
def model_dir(make_tiny_llama):
    """A tiny random Llama whose greedy output wanders (larger weights than the shared one's,
    which repeats a token or two), so a prediction's alignment has something to follow."""
    return make_tiny_llama(initializer_range=0.3)


@pytest.fixture(scope="module")
def plain_llm(model_dir):
    return LLM(str(model_dir), num_kv_blocks=256, block_size=4)


@pytest.fixture(scope="module")
def prompts_and_greedy(plain_llm):
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randrange(8, 20))] for _ in range(4)]
    outputs = plain_llm.generate(prompts, SamplingParams(**GREEDY))
    return prompts, [o.outputs[0].token_ids for o in outputs]


def predictions_for(expected: list[int]) -> dict[str, list[int]]:
    """A prediction equal to the output, one that differs in the middle, an unrelated one, an empty one."""
    middle = expected[:8] + [11, 12, 13] + expected[15:]  # the edit inside the first proposal
    unrelated = [random.Random(len(expected)).randrange(3, 49152) for _ in range(len(expected))]
    return {"equal": expected, "middle": middle, "unrelated": unrelated, "empty": []}


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_greedy_output_is_the_same_whatever_the_prediction(model_dir, prompts_and_greedy, speculative):
    prompts, expected = prompts_and_greedy
    llm = LLM(str(model_dir), num_kv_blocks=256, block_size=4, speculative=speculative)
    engine = llm.engine
    for prompt, want in zip(prompts[:2], expected):
        for kind, prediction in predictions_for(want).items():
            before = engine.spec_stats.num_steps
            out = llm.generate(prompt, SamplingParams(**GREEDY, prediction=prediction))[0].outputs[0]
            assert out.token_ids == want, kind
            assert out.accepted_prediction_tokens <= len(want) - 1
            if kind == "equal":  # nearly all land, in far fewer verify steps than tokens
                assert out.accepted_prediction_tokens >= 0.9 * (len(want) - 1)
                assert engine.spec_stats.num_steps - before <= len(want) // 4
            if kind == "empty" and speculative is None:
                assert engine.spec_stats.num_steps == before
            if kind in ("unrelated", "empty"):
                assert out.accepted_prediction_tokens == 0
    llm.check_integrity()
    assert engine.kv.num_free_blocks == 256


def test_counts_add_up_per_token_and_in_the_engine_totals(model_dir, prompts_and_greedy):
    prompts, expected = prompts_and_greedy
    llm = LLM(str(model_dir), num_kv_blocks=256, block_size=4)
    engine = llm.engine
    prediction = predictions_for(expected[0])["middle"]
    engine.add_request("r", prompts[0], SamplingParams(**GREEDY, prediction=prediction))
    deltas = [d.outputs[0] for _ in range(200) if engine.has_unfinished() for d in engine.step()]
    assert [t for d in deltas for t in d.token_ids] == expected[0]
    assert all(len(d.token_ids) == 1 and d.accepted_prediction_tokens in (0, 1) for d in deltas)
    accepted = sum(d.accepted_prediction_tokens for d in deltas)
    rejected = sum(d.rejected_prediction_tokens for d in deltas)
    stats = engine.stats()
    assert (stats.prediction_accepted, stats.prediction_rejected) == (accepted, rejected)
    assert stats.spec_proposed == accepted + rejected and stats.spec_accepted == accepted
    assert 0 < rejected and accepted >= len(expected[0]) - 15
    llm.check_integrity()


def test_a_stop_inside_accepted_tokens_counts_only_the_tokens_kept(plain_llm, prompts_and_greedy):
    prompts, expected = prompts_and_greedy
    stop_id = next(t for i, t in enumerate(expected[0]) if i >= 10 and t not in expected[0][:i])
    params = SamplingParams(**GREEDY, prediction=expected[0], stop_token_ids=[stop_id])
    out = plain_llm.generate(prompts[0], params)[0].outputs[0]
    assert out.token_ids == expected[0][:expected[0].index(stop_id) + 1]
    assert 0 < out.accepted_prediction_tokens < len(out.token_ids)
    plain_llm.check_integrity()


@pytest.mark.parametrize("ruled_out", [dict(speculative=False), dict(repetition_penalty=1.3),
                                       dict(presence_penalty=0.5)])
def test_a_request_that_may_not_speculate_is_served_normally(plain_llm, prompts_and_greedy, ruled_out):
    prompts, expected = prompts_and_greedy
    params = dict(GREEDY, **ruled_out)
    want = plain_llm.generate(prompts[0], SamplingParams(**params))[0].outputs[0].token_ids
    before = plain_llm.engine.spec_stats.num_steps
    out = plain_llm.generate(prompts[0], SamplingParams(**params, prediction=want))[0].outputs[0]
    assert out.token_ids == want and plain_llm.engine.spec_stats.num_steps == before
    assert out.accepted_prediction_tokens == out.rejected_prediction_tokens == 0
    plain_llm.check_integrity()


@pytest.mark.parametrize("speculative", [None, "ngram", "draft"])
def test_a_mixed_batch_gives_each_request_its_greedy_output(model_dir, plain_llm, prompts_and_greedy,
                                                           speculative):
    """Requests without a prediction, or whose prediction is not found, get the server's own
    proposals (a draft model's: the target itself here), which go on from where the prediction's
    stopped."""
    prompts, expected = prompts_and_greedy
    if speculative == "draft":
        speculative = f"draft:{model_dir}"
    penalized = plain_llm.generate(prompts[3], SamplingParams(**GREEDY, repetition_penalty=1.2))[0].outputs[0]
    llm = LLM(str(model_dir), num_kv_blocks=256, block_size=4, speculative=speculative)
    params = [SamplingParams(**GREEDY, prediction=expected[0]), SamplingParams(**GREEDY),
              SamplingParams(**GREEDY, prediction=predictions_for(expected[2])["middle"]),
              SamplingParams(**GREEDY, repetition_penalty=1.2, prediction=expected[3])]
    outputs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs[:3]] == expected[:3]
    assert outputs[0].outputs[0].accepted_prediction_tokens > 30
    assert outputs[3].outputs[0].token_ids == penalized.token_ids
    assert outputs[3].outputs[0].accepted_prediction_tokens == 0
    llm.check_integrity()
    assert llm.engine.kv.num_free_blocks == 256
    if llm.engine.draft is not None:
        assert not llm.engine.draft.shadows and llm.engine.spec_stats.num_accepted > llm.engine.prediction_totals[0]


def test_above_the_max_batch_nothing_is_proposed(model_dir, prompts_and_greedy):
    prompts, expected = prompts_and_greedy
    llm = LLM(str(model_dir), num_kv_blocks=256, block_size=4, speculative_max_batch=2)
    outputs = llm.generate(prompts[:3], [SamplingParams(**GREEDY, prediction=want) for want in expected[:3]])
    assert [o.outputs[0].token_ids for o in outputs] == expected[:3]
    assert llm.engine.spec_stats.num_steps == 0  # three decoding throughout: the bound holds
    llm.check_integrity()


def test_sampled_output_with_a_prediction_is_valid_and_seeded(plain_llm, prompts_and_greedy):
    prompts, expected = prompts_and_greedy
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=30, ignore_eos=True, logprobs=1,
                            prediction=expected[0])
    first = plain_llm.generate(prompts[0], params)[0].outputs[0]
    again = plain_llm.generate(prompts[0], params)[0].outputs[0]
    assert first.token_ids == again.token_ids and len(first.token_ids) == 30
    assert [lp.token_id for lp in first.logprobs] == first.token_ids
    plain_llm.check_integrity()
