"""The OpenAI conformance and error tests of the single-process server, run unchanged against
the scaled-out one (model ``tiny``: two replicas behind the ingress)."""

from __future__ import annotations

from tests.server.test_chat import (  # noqa: F401 - collected here with this package's server
    test_bookkeeping_fields_clients_send_are_accepted, test_logprobs_have_top_alternatives,
    test_n_choices_each_complete, test_repeated_prompt_reports_cached_tokens,
    test_seed_makes_sampling_reproducible, test_stop_string_ends_the_answer_before_it,
    test_stream_matches_whole_answer_and_ends_with_usage,
    test_whole_answer_has_usage_timings_and_true_finish_reason)
from tests.server.test_completions import (  # noqa: F401
    test_default_max_tokens_is_sixteen, test_echo_prepends_the_prompt, test_logprobs_per_token,
    test_min_tokens_and_extras_are_accepted, test_prompt_shapes_give_one_choice_per_prompt_and_n,
    test_streamed_multi_prompt_covers_every_choice, test_whole_and_streamed_text_agree)
from tests.server.test_contract import test_request_ids_run_through_body_header_and_stream  # noqa: F401
from tests.server.test_errors import (  # noqa: F401
    test_bad_input_is_answered_then_serving_goes_on, test_context_overflow_names_both_numbers,
    test_malformed_json_is_a_400, test_unknown_route_and_method_get_error_bodies)
from tests.server.test_metrics import DOCUMENTED, assert_exposed


def test_application_metrics_are_exposed(server) -> None:
    """Every application-level series of a single-process server (the engine's step timings
    stay with each replica)."""
    assert_exposed(server, DOCUMENTED)
