"""OpenAI schemas: valid requests parse, each invalid field is a 400 naming it, and our responses are accepted
by the official `openai` client's own models (including the usage extension)."""

from __future__ import annotations

import json
from typing import Any

import openai.types as oai
import openai.types.chat as oai_chat
import pytest
from pydantic import ValidationError

from specray.coordinator.stats import LevelStats
from specray.serve.protocol import (
    SSE_DONE,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamChunk,
    InvalidRequest,
    ModelCard,
    ModelList,
    error_response_body,
    model_not_found_body,
    sse_event,
    usage_from_stats,
    validation_error_to_openai,
)
from specray.spec.params import SamplingParams, VerifyMethod

CHAT = [{"role": "user", "content": "hi"}]


def _error(cls: type, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    with pytest.raises(ValidationError) as info:
        cls.model_validate(body)
    return validation_error_to_openai(info.value)


# ---------------------------------------------------------------------------------------------- valid


def test_completion_defaults_follow_openai() -> None:
    req = CompletionRequest.model_validate({"model": "m", "prompt": "hello"})
    assert req.max_tokens == 16 and req.temperature == 1.0 and req.top_p == 1.0 and req.n == 1
    assert req.stream is False and req.stop is None and req.speculation is None and req.ignore_eos is False
    assert req.to_sampling_params() == SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=None)


def test_completion_full_request() -> None:
    req = CompletionRequest.model_validate(
        {
            "model": "m",
            "prompt": [1, 2, 3],
            "max_tokens": 5,
            "temperature": 0,
            "top_p": 0.9,
            "top_k": 40,
            "seed": 7,
            "stop": "\n",
            "n": 1,
            "stream": True,
            "stream_options": {"include_usage": True},
            "echo": False,
            "logprobs": None,
            "presence_penalty": 0,
            "frequency_penalty": 0.0,
            "user": "someone",
            "best_of": 1,
            "speculation": {"method": "cascade", "num_speculative_tokens": 8, "verify_method": "coupled"},
            "ignore_eos": True,
        }
    )
    assert req.prompt == [1, 2, 3] and req.stop == ["\n"] and req.include_usage_chunk
    assert req.speculation is not None and req.speculation.verify is VerifyMethod.COUPLED
    assert req.to_sampling_params() == SamplingParams(temperature=0.0, top_k=40, top_p=0.9, seed=7)


@pytest.mark.parametrize("prompt", [["only one"], [[5, 6]]])
def test_single_prompt_in_a_list_is_accepted(prompt: list[Any]) -> None:
    assert CompletionRequest.model_validate({"model": "m", "prompt": prompt}).prompt == prompt[0]


@pytest.mark.parametrize("top_k", [-1, 0, None])
def test_top_k_off_values(top_k: int | None) -> None:
    req = CompletionRequest.model_validate({"model": "m", "prompt": "x", "top_k": top_k})
    assert req.to_sampling_params().top_k == 0


def test_chat_request_parses_parts_and_roles() -> None:
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": "ok", "name": "bot"},
            ],
            "max_completion_tokens": 9,
            "temperature": None,
            "stop": ["x", "y"],
            "speculation": {"method": "none"},
            "metadata": {"k": "v"},
            "store": False,
            "logprobs": False,
            "tool_choice": "none",
            "response_format": {"type": "text"},
        }
    )
    assert req.template_messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "ok"},
    ]
    assert req.max_new_tokens == 9 and req.to_sampling_params().temperature == 1.0
    assert req.resolve_max_tokens(prompt_tokens=10, max_context=100) == 9


def test_max_tokens_resolution() -> None:
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": CHAT})
    assert chat.resolve_max_tokens(30, 100) == 70  # chat default: up to the context
    assert ChatCompletionRequest.model_validate({"model": "m", "messages": CHAT, "max_tokens": 3}).max_new_tokens == 3
    comp = CompletionRequest.model_validate({"model": "m", "prompt": "x", "max_tokens": 50})
    assert comp.resolve_max_tokens(50, 100) == 50
    with pytest.raises(InvalidRequest) as info:
        comp.resolve_max_tokens(60, 100)
    assert info.value.param == "max_tokens" and "100" in str(info.value)
    with pytest.raises(InvalidRequest) as info:
        chat.resolve_max_tokens(100, 100)
    assert info.value.body()["error"]["param"] == "messages"


# -------------------------------------------------------------------------------------------- invalid

INVALID_COMPLETIONS = [
    ({"temperature": 5}, "temperature", "<= 2 (got 5)"),
    ({"temperature": -0.1}, "temperature", ">= 0"),
    ({"temperature": float("nan")}, "temperature", "finite"),
    ({"top_p": 0}, "top_p", "> 0"),
    ({"top_p": 1.5}, "top_p", "<= 1"),
    ({"top_k": -2}, "top_k", ">= -1"),
    ({"seed": -1}, "seed", ">= 0"),
    ({"seed": 2**63}, "seed", "< 9223372036854775808"),
    ({"max_tokens": 0}, "max_tokens", ">= 1"),
    ({"max_tokens": "many"}, "max_tokens", "integer"),
    ({"n": 0}, "n", ">= 1"),
    ({"n": 65}, "n", "<= 64"),
    ({"best_of": 3}, "best_of", "not supported"),
    ({"echo": True}, "echo", "not supported"),
    ({"logprobs": 21}, "logprobs", "<= 20"),
    ({"logprobs": -1}, "logprobs", ">= 0"),
    ({"presence_penalty": 2.5}, "presence_penalty", "<= 2"),
    ({"frequency_penalty": -2.1}, "frequency_penalty", ">= -2"),
    ({"min_p": 1.1}, "min_p", "<= 1"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias", "not supported"),
    ({"suffix": "tail"}, "suffix", "not supported"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"stop": [""]}, "stop", "must not be empty"),
    ({"stop": 5}, "stop", "list"),
    ({"prompt": ["a", "b"]}, "prompt", "only one prompt per request"),
    ({"prompt": []}, "prompt", "must not be empty"),
    ({"prompt": [1, -1]}, "prompt", "non-negative"),
    ({"prompt": 3}, "prompt", "string or a list"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream"),
    ({"stream": True, "stream_options": {"extra": 1}}, "stream_options.extra", "unknown field"),
    ({"speculation": {"method": "magic"}}, "speculation.method", "'cascade', 'hybrid' or 'auto' (got 'magic')"),
    ({"speculation": {"num_speculative_tokens": 0}}, "speculation.num_speculative_tokens", ">= 1"),
    ({"speculation": {"num_speculative_tokens": 33}}, "speculation.num_speculative_tokens", "<= 32"),
    ({"speculation": {"verify_method": "fast"}}, "speculation.verify_method", "'coupled'"),
    ({"speculation": {"k": 3}}, "speculation.k", "unknown field"),
    ({"repetition_penalty": 0}, "repetition_penalty", "> 0"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": 1}}, "stream_options.continuous_usage_stats",
     "boolean"),
    ({"guided_regex": "a+"}, "guided_regex", "only null is supported"),
    ({"stop_token_ids": [3, -2]}, "stop_token_ids", ">= 0"),
]


@pytest.mark.parametrize(("patch", "param", "fragment"), INVALID_COMPLETIONS)
def test_invalid_completion_field_is_a_400_naming_it(patch: dict[str, Any], param: str, fragment: str) -> None:
    status, body = _error(CompletionRequest, {"model": "m", "prompt": "x", **patch})
    assert status == 400
    err = body["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert err["message"].startswith(f"{param}: ") and fragment in err["message"], err["message"]


INVALID_CHATS = [
    ({"messages": []}, "messages", "at least 1 item"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role", "'user'"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "field required"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "string or a list"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages[0].content",
        "only text parts",
    ),
    ({"max_completion_tokens": 0}, "max_completion_tokens", ">= 1"),
    ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens", "disagrees"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tool calling"),
    ({"tool_choice": "auto"}, "tool_choice", "tool calling"),
    ({"response_format": {"type": "json_object"}}, "response_format", "only response_format"),
    ({"logprobs": 2}, "logprobs", "boolean"),
    ({"top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "<= 20"),
    ({"n": 0}, "n", ">= 1 (got 0)"),
    ({"temperature": 2.5}, "temperature", "<= 2 (got 2.5)"),
    ({"functions": [{"name": "f"}]}, "functions", "only [] is supported"),
    ({"continue_final_message": True}, "continue_final_message", "only False is supported"),
]


def test_unknown_top_level_fields_are_kept_and_named() -> None:
    """vLLM accepts what it does not know (and logs it); nested objects still refuse unknown keys."""
    req = CompletionRequest.model_validate({"model": "m", "prompt": "x", "best_effort": True, "zeta": 1, "alpha": 2})
    assert req.unknown_fields == ["alpha", "best_effort", "zeta"]
    assert CompletionRequest.model_validate({"model": "m", "prompt": "x", "min_p": 0.0}).unknown_fields == []
    status, body = _error(ChatCompletionRequest, {"model": "m", "messages": CHAT, "speculation": {"k": 1}})
    assert status == 400 and body["error"]["param"] == "speculation.k"


@pytest.mark.parametrize(("patch", "param", "fragment"), INVALID_CHATS)
def test_invalid_chat_field_is_a_400_naming_it(patch: dict[str, Any], param: str, fragment: str) -> None:
    status, body = _error(ChatCompletionRequest, {"model": "m", "messages": CHAT, **patch})
    assert status == 400 and body["error"]["param"] == param
    assert body["error"]["message"].startswith(f"{param}: ") and fragment in body["error"]["message"]


def test_missing_model_and_bad_json() -> None:
    _, body = _error(CompletionRequest, {"prompt": "x"})
    assert body["error"]["message"] == "model: field required"
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate_json("{not json")
    assert "invalid JSON" in validation_error_to_openai(info.value)[1]["error"]["message"]
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate_json("[1, 2]")
    assert validation_error_to_openai(info.value)[1]["error"]["message"] == "the request body must be a JSON object"


def test_several_errors_are_listed() -> None:
    _, body = _error(CompletionRequest, {"model": "m", "prompt": "x", "temperature": 9, "top_p": 9})
    assert "temperature: must be <= 2" in body["error"]["message"] and "top_p: must be <= 1" in body["error"]["message"]
    assert body["error"]["param"] == "temperature"


def test_error_bodies() -> None:
    assert error_response_body("boom") == {
        "error": {"message": "boom", "type": "invalid_request_error", "param": None, "code": None}
    }
    body = model_not_found_body("gpt-9")
    assert body["error"]["code"] == "model_not_found" and body["error"]["type"] == "invalid_request_error"
    assert "gpt-9" in body["error"]["message"] and body["error"]["param"] == "model"


# ------------------------------------------------------------------------------------------- responses


def _stats() -> dict[str, LevelStats]:
    mid, target = LevelStats(), LevelStats()
    mid.record(4, 3, 4)
    mid.record(4, 4, 5)
    target.record(5, 2, 3)
    target.record(0, 0, 1)
    return {"mid": mid, "target": target}


def test_usage_from_stats() -> None:
    usage = usage_from_stats(10, 8, _stats())
    assert usage.total_tokens == 18
    assert usage.speculation is not None
    mid = usage.speculation["mid"]
    assert (mid.num_drafts, mid.draft_tokens, mid.accepted_tokens) == (2, 8, 7)
    assert mid.acceptance_rate == pytest.approx(7 / 8) and mid.mean_acceptance_length == pytest.approx(4.5)
    assert usage.speculation["target"].acceptance_rate == pytest.approx(0.4)
    assert list(usage.speculation) == ["mid", "target"]
    plain = usage_from_stats(3, 4)
    assert plain.speculation is None and "speculation" not in plain.model_dump()


def test_usage_names_each_drafter_verifier_pair() -> None:
    from specray.coordinator.stats import named_stats

    raw = {(1, 0): LevelStats(), (2, 0): LevelStats(), (2, 1): LevelStats(), (2, None): LevelStats()}
    raw[(1, 0)].record(3, 1, 2)
    raw[(2, 0)].record(3, 3, 4)
    raw[(2, 1)].record(4, 0, 1)
    raw[(2, None)].record(0, 0, 1)  # a plain round: no drafter, in the level's totals only
    spec = usage_from_stats(5, 8, named_stats(["ngram", "mid", "target"], raw)).model_dump(mode="json")["speculation"]
    assert spec["mid"]["pair"] == "ngram->mid" and list(spec["mid"]["pairs"]) == ["ngram->mid"]
    target = spec["target"]
    assert target["pair"] == "ngram+mid->target" and list(target["pairs"]) == ["ngram->target", "mid->target"]
    assert target["pairs"]["ngram->target"]["acceptance_rate"] == 1.0 and target["pairs"]["mid->target"][
        "acceptance_rate"] == 0.0
    assert target["draft_tokens"] == 7 and target["mean_acceptance_length"] == pytest.approx(6 / 3)
    plain = usage_from_stats(1, 1, {"target": LevelStats()}).model_dump(mode="json")["speculation"]["target"]
    assert "pair" not in plain and plain["pairs"] == {}


def _roundtrip(obj: Any) -> dict[str, Any]:
    """What a client receives: our JSON text, parsed."""
    return json.loads(obj.model_dump_json())


def test_completion_response_accepted_by_openai_client() -> None:
    resp = CompletionResponse(
        model="m",
        choices=[CompletionChoice(text="Hello 😀", finish_reason="length")],
        usage=usage_from_stats(3, 16, _stats()),
    )
    parsed = oai.Completion.model_validate(_roundtrip(resp))
    assert parsed.id.startswith("cmpl-") and parsed.choices[0].text == "Hello 😀"
    assert parsed.usage is not None and parsed.usage.total_tokens == 19
    spec = parsed.usage.model_extra["speculation"]  # the extension survives the client's parsing
    assert spec["mid"]["accepted_tokens"] == 7


def test_completion_stream_chunks_accepted_by_openai_client() -> None:
    last = CompletionStreamChunk(
        id="cmpl-1", model="m", choices=[CompletionStreamChoice(text="", finish_reason="stop")]
    )
    assert oai.Completion.model_validate(_roundtrip(last)).choices[0].finish_reason == "stop"
    mid = _roundtrip(CompletionStreamChunk(id="cmpl-1", model="m", choices=[CompletionStreamChoice(text="ab")]))
    assert mid["choices"][0] == {"index": 0, "text": "ab", "logprobs": None, "finish_reason": None}
    usage = CompletionStreamChunk(id="cmpl-1", model="m", usage=usage_from_stats(1, 2))
    parsed = oai.Completion.model_validate(_roundtrip(usage))
    assert parsed.choices == [] and parsed.usage is not None and parsed.usage.completion_tokens == 2


def test_chat_response_accepted_by_openai_client() -> None:
    resp = ChatCompletionResponse(
        model="m",
        choices=[ChatChoice(message=ChatResponseMessage(content="Bonjour"), finish_reason="stop")],
        usage=usage_from_stats(5, 2, _stats()),
    )
    parsed = oai_chat.ChatCompletion.model_validate(_roundtrip(resp))
    assert parsed.object == "chat.completion" and parsed.id.startswith("chatcmpl-")
    assert parsed.choices[0].message.content == "Bonjour" and parsed.choices[0].message.role == "assistant"
    assert parsed.usage is not None and parsed.usage.model_extra["speculation"]["target"]["num_drafts"] == 1


def test_chat_chunks_accepted_by_openai_client() -> None:
    chunks = [
        ChatCompletionChunk(
            id="c", model="m", choices=[ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))]
        ),
        ChatCompletionChunk(id="c", model="m", choices=[ChatChunkChoice(delta=ChatDelta(content="Hé"))]),
        ChatCompletionChunk(id="c", model="m", choices=[ChatChunkChoice(finish_reason="length")]),
        ChatCompletionChunk(id="c", model="m", usage=usage_from_stats(5, 2, _stats())),
    ]
    parsed = [oai_chat.ChatCompletionChunk.model_validate(_roundtrip(c)) for c in chunks]
    assert parsed[0].choices[0].delta.role == "assistant"
    assert parsed[1].choices[0].delta.content == "Hé" and parsed[1].choices[0].delta.role is None
    assert parsed[2].choices[0].finish_reason == "length"
    assert parsed[3].choices == [] and parsed[3].usage is not None and parsed[3].usage.prompt_tokens == 5
    assert _roundtrip(chunks[1])["choices"][0]["delta"] == {"content": "Hé"}  # no null role, as OpenAI sends
    assert _roundtrip(chunks[2])["choices"][0]["delta"] == {}


def test_models_accepted_by_openai_client() -> None:
    models = ModelList(data=[ModelCard(id="qwen-0.5b", max_model_len=2048), ModelCard(id="other")])
    data = _roundtrip(models)
    parsed = [oai.Model.model_validate(m) for m in data["data"]]
    assert parsed[0].id == "qwen-0.5b" and parsed[0].owned_by == "specray" and data["object"] == "list"
    assert "max_model_len" not in data["data"][1]


def test_sse_framing() -> None:
    chunk = ChatCompletionChunk(id="c", model="m", choices=[ChatChunkChoice(delta=ChatDelta(content="世界"))])
    event = sse_event(chunk)
    assert event.startswith("data: ") and event.endswith("\n\n") and "\n" not in event[:-2]
    assert json.loads(event[len("data: ") :]) == _roundtrip(chunk) and "世界" in event
    assert sse_event({"a": "é"}) == 'data: {"a":"é"}\n\n'
    assert SSE_DONE == "data: [DONE]\n\n"


def test_fastapi_request_validation_error_is_translated() -> None:
    from fastapi.exceptions import RequestValidationError

    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "top_p": 3})
    errors = [{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()]
    status, body = validation_error_to_openai(RequestValidationError(errors))
    assert status == 400 and body["error"]["message"] == "top_p: must be <= 1 (got 3)"


def test_schemas_render_for_openapi() -> None:
    for cls in (CompletionRequest, ChatCompletionRequest):
        assert "properties" in cls.model_json_schema()
    for cls in (CompletionResponse, ChatCompletionResponse, ChatCompletionChunk, CompletionStreamChunk, ModelList):
        cls.model_json_schema(mode="serialization")
