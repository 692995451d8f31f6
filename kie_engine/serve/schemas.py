"""Request bodies of /v1/chat/completions and /v1/completions, checked field by field into
typed requests.  Every refusal is an ApiError naming the parameter: wrong JSON type 400,
out of range 400, unknown model 404, a parameter this engine does not implement 400 (never
silently ignored when it would change the answer).  Unknown fields are ignored, as clients
send vendor extras."""
import json
import math
from dataclasses import dataclass, field
from typing import List, Optional

from ..generate import SEED_MAX
from .api_error import ApiError, bad

MAX_STOP = 16
ROLES = {"system", "developer", "user", "assistant"}  # developer: OpenAI's newer name for system


def _reject_constant(name):
    raise ValueError(f"{name} is not valid JSON")


def parse_json(raw: bytes):
    """The body as a JSON object (NaN and Infinity are not JSON and are refused)."""
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:  # json's parser recurses once per nesting level
        raise ApiError(400, "the request body is nested too deeply to read", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {_kind(body)}", code="invalid_json")
    return body


def _kind(v):
    if v is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(v), type(v).__name__)


def _type_error(name, want, v):
    return bad(f"'{name}' must be {want}, got {_kind(v)}", name, "invalid_type")


def _int(body, name, default=None, lo=None, hi=None):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise _type_error(name, "an integer", v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise bad(f"'{name}' is {v}; it must be {_range(lo, hi)}", name)
    return v


def _number(body, name, default, lo=None, hi=None, lo_open=False):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _type_error(name, "a number", v)
    if (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
        raise bad(f"'{name}' is {v}; it must be {_range(lo, hi, lo_open)}", name)
    return float(v)


def _range(lo, hi, lo_open=False):
    if lo is not None and hi is not None:
        return f"{'>' if lo_open else '>='} {lo} and <= {hi}"
    return f"{'>' if lo_open else '>='} {lo}" if lo is not None else f"<= {hi}"


def _bool(body, name, default=False):
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _type_error(name, "a boolean", v)
    return v


def _unsupported(body, name, default_ok):
    """A parameter that would change the answer in a way this engine does not implement:
    accepted only at its no-op value."""
    if name in body and body[name] is not None and not default_ok(body[name]):
        raise bad(f"'{name}' is not supported by this server", name, "unsupported_parameter")


@dataclass
class Common:
    model: str
    max_tokens: Optional[int]      # None: the rest of the context
    temperature: float
    top_p: float
    top_k: int
    seed: Optional[int]
    stop: List[str]
    stream: bool
    include_usage: bool
    ignore_eos: bool


@dataclass
class ChatRequest(Common):
    messages: List[dict] = field(default_factory=list)


@dataclass
class CompletionRequest(Common):
    prompt: object = None          # a string, or a list of token ids


def _common(body, model_id, max_tokens_names):
    model = body.get("model")
    if model is None:
        raise bad("'model' is required", "model", "missing_required_parameter")
    if not isinstance(model, str):
        raise _type_error("model", "a string", model)
    if model != model_id:
        raise ApiError(404, f"the model '{model}' does not exist; this server serves '{model_id}'",
                       param="model", code="model_not_found")
    n = _int(body, "n", 1)
    if n != 1:
        raise bad(f"'n' is {n}; this server generates one choice per request (n = 1)", "n")
    max_tokens = None
    for name in max_tokens_names:  # the first one given wins (max_completion_tokens is the newer name)
        v = _int(body, name, None, lo=1)
        if v is not None and max_tokens is None:
            max_tokens = v
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        if len(stop) > MAX_STOP:
            raise bad(f"'stop' has {len(stop)} strings; at most {MAX_STOP}", "stop")
    else:
        raise _type_error("stop", "a string or an array of strings", stop)
    if any(s == "" for s in stop):
        raise bad("'stop' strings must not be empty", "stop")
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise _type_error("stream_options", "an object", opts)
        if not stream:
            raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
        include_usage = _bool(opts, "include_usage")
    top_k = _int(body, "top_k", 0, lo=-1)
    for name in ("frequency_penalty", "presence_penalty", "repetition_penalty"):
        _unsupported(body, name, lambda v: v == (1 if name == "repetition_penalty" else 0))
    _unsupported(body, "logit_bias", lambda v: v == {})
    return dict(model=model, max_tokens=max_tokens,
                temperature=_number(body, "temperature", 1.0, 0, 2),
                top_p=_number(body, "top_p", 1.0, 0, 1, lo_open=True),
                top_k=0 if top_k == -1 else top_k,  # -1: vLLM's spelling of "off"
                seed=_int(body, "seed", lo=0, hi=SEED_MAX), stop=stop, stream=stream, include_usage=include_usage,
                ignore_eos=_bool(body, "ignore_eos"))


def _content(m, i):
    """A message's text: a string, or an array of text parts (joined)."""
    c = m.get("content")
    where = f"messages[{i}].content"
    if isinstance(c, str):
        return c
    if c is None and m.get("role") == "assistant":
        return ""
    if isinstance(c, list):
        parts = []
        for j, p in enumerate(c):
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise bad(f"{where}[{j}] must be a text part {{\"type\": \"text\", \"text\": ...}} (this model "
                          f"reads text only)", where)
            parts.append(p["text"])
        return "".join(parts)
    raise _type_error(where, "a string or an array of text parts", c)


def parse_chat(body, model_id):
    common = _common(body, model_id, ("max_completion_tokens", "max_tokens"))
    msgs = body.get("messages")
    if msgs is None:
        raise bad("'messages' is required", "messages", "missing_required_parameter")
    if not isinstance(msgs, list):
        raise _type_error("messages", "an array", msgs)
    if not msgs:
        raise bad("'messages' must hold at least one message", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _type_error(f"messages[{i}]", "an object", m)
        role = m.get("role")
        if not isinstance(role, str):
            raise _type_error(f"messages[{i}].role", "a string", role)
        if role not in ROLES:
            raise bad(f"messages[{i}].role is '{role}'; this server takes {', '.join(sorted(ROLES))}",
                      f"messages[{i}].role")
        out.append({"role": "system" if role == "developer" else role, "content": _content(m, i)})
    for name in ("tools", "functions"):
        _unsupported(body, name, lambda v: v == [])
    _unsupported(body, "tool_choice", lambda v: v == "none")
    _unsupported(body, "logprobs", lambda v: v is False)
    _unsupported(body, "top_logprobs", lambda v: False)
    _unsupported(body, "response_format", lambda v: isinstance(v, dict) and v.get("type") == "text")
    return ChatRequest(**common, messages=out)


def parse_completion(body, model_id, vocab_size):
    common = _common(body, model_id, ("max_tokens",))
    p = body.get("prompt")
    if p is None:
        raise bad("'prompt' is required", "prompt", "missing_required_parameter")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # one prompt in a batch of one
    if isinstance(p, list):
        if not p:
            raise bad("'prompt' is empty", "prompt")
        if isinstance(p[0], (str, list)):
            raise bad(f"'prompt' holds {len(p)} prompts; this server takes one per request", "prompt")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            raise _type_error("prompt", "a string or an array of token ids", p)
        if not all(0 <= t < vocab_size for t in p):
            raise bad(f"'prompt' holds token ids outside 0..{vocab_size - 1}", "prompt")
    elif not isinstance(p, str):
        raise _type_error("prompt", "a string or an array of token ids", p)
    _unsupported(body, "echo", lambda v: v is False)
    _unsupported(body, "suffix", lambda v: v == "")
    _unsupported(body, "logprobs", lambda v: v == 0)
    _unsupported(body, "best_of", lambda v: v == 1)
    return CompletionRequest(**common, prompt=p)


def check_context(n_prompt, max_tokens, context):
    """max_tokens for a prompt of n_prompt tokens (None: the rest of the context); 400 with
    the numbers when they do not fit."""
    if n_prompt == 0:
        raise bad("the prompt encodes to no tokens", "prompt")
    if max_tokens is None:
        if n_prompt >= context:
            raise ApiError(400, f"this model's maximum context length is {context} tokens; the prompt has "
                                f"{n_prompt} tokens, which leaves no room for a completion",
                           param="messages", code="context_length_exceeded")
        return context - n_prompt
    if n_prompt + max_tokens > context:
        raise ApiError(400, f"this model's maximum context length is {context} tokens; you requested "
                            f"{n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} for the "
                            f"completion)", param="max_tokens", code="context_length_exceeded")
    return max_tokens
