"""OpenAI-compatible schemas (pydantic v2) for /v1/completions, /v1/chat/completions and /v1/models, error bodies
and SSE framing: `requests` (what clients send), `responses` (what they get back), `errors` (400/404 bodies).

Extensions (all optional, so plain OpenAI clients work unchanged; send them with ``extra_body=``):
`speculation` (SpeculationOptions), `top_k`, `ignore_eos` on requests, and `usage.speculation` (per-level
acceptance stats) and `ModelCard.max_model_len` on responses.
"""

from specray.serve.protocol.errors import (
    Busy,
    ErrorBody,
    ErrorDetail,
    InvalidRequest,
    error_response_body,
    model_not_found_body,
    validation_error_to_openai,
)
from specray.serve.protocol.requests import (
    MAX_STOP_STRINGS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SpeculationOptions,
    StreamOptions,
)
from specray.serve.protocol.responses import (
    SSE_DONE,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamChunk,
    FinishReason,
    ModelCard,
    ModelList,
    SpeculationLevelUsage,
    SpeculationPairUsage,
    TopLogprob,
    Usage,
    new_id,
    sse_event,
    usage_from_stats,
)

__all__ = [
    "MAX_STOP_STRINGS", "SSE_DONE", "Busy", "ChatChoice", "ChatChunkChoice", "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatCompletionResponse", "ChatDelta", "ChatLogprobs", "ChatMessage", "ChatResponseMessage", "ChatTokenLogprob",
    "CompletionChoice", "CompletionLogprobs", "CompletionRequest", "CompletionResponse", "CompletionStreamChoice",
    "CompletionStreamChunk", "ErrorBody", "ErrorDetail", "FinishReason", "InvalidRequest", "ModelCard", "ModelList",
    "SpeculationLevelUsage", "SpeculationOptions", "SpeculationPairUsage", "StreamOptions", "TopLogprob", "Usage",
    "error_response_body", "model_not_found_body", "new_id", "sse_event", "usage_from_stats",
    "validation_error_to_openai",
]
