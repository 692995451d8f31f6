"""Chat templates: the jinja2 template a model ships (GGUF metadata
`tokenizer.chat_template`, or a Hugging Face directory's chat_template.jinja /
tokenizer_config.json) rendered the way transformers' `apply_chat_template(messages,
add_generation_prompt=True)` renders it: a sandboxed environment with trim_blocks and
lstrip_blocks, the loop-controls extension, a `tojson` that keeps non-ASCII text,
`raise_exception` and `strftime_now`, and the special tokens (bos_token, eos_token, ...)
as variables.  The rendered text is then tokenized without adding BOS/EOS (the template
writes whatever special tokens it wants).

A template is code that comes with the checkpoint: it is compiled and rendered in a child
process with a time limit per render and a memory limit (kie_engine/formats/bounded.py), so that
one that loops without end or builds a gigabyte string fails with a ChatTemplateError.
The child is long-lived (one per ChatTemplate, forked at its first render): it compiles
the template once and renders request after request, so a render costs a pipe round trip
rather than a fork; one that overruns is killed and the next render forks a new one."""
import functools
import json
import threading
from datetime import datetime

from ..errors import ConfigError

# A piece of text no template contains: rendering an assistant turn around it shows what
# the template writes after a turn (its end-of-turn token).
_PROBE = "KIE-END-OF-TURN-PROBE"


class ChatTemplateError(ConfigError):
    """The chat template does not compile or fails while rendering."""


class ChatTemplate:
    # Bounds on compiling and rendering one conversation (kie_engine/formats/bounded.py): a
    # template is code from the checkpoint, and may try to loop or allocate without end.
    # memory_limit is taken when the renderer process starts (the first render).
    time_limit = 10.0
    memory_limit = 512 << 20

    def __init__(self, text, special_tokens=None, source="chat template", eot_token_id=None):
        self.text, self.source = text, source
        self.special_tokens = dict(special_tokens or {})
        self.eot_token_id = eot_token_id
        self._worker = None
        self._worker_lock = threading.Lock()

    def _renderer(self):
        from . import bounded
        with self._worker_lock:
            if self._worker is None:
                self._worker = bounded.Worker(functools.partial(_compile, self.text, self.special_tokens),
                                              self.memory_limit)
            return self._worker

    def close(self):
        """Ends the renderer process now (else it ends when the template is dropped)."""
        with self._worker_lock:
            if self._worker is not None:
                self._worker.close()
                self._worker = None

    def render(self, messages, add_generation_prompt=True):
        """The prompt text of a conversation ([{'role', 'content'}, ...]), rendered in the
        bounded renderer process (ChatTemplateError when it fails or overruns)."""
        from . import bounded
        try:
            import jinja2.ext  # noqa: F401  (imported here, before the fork: the child finds it loaded)
            import jinja2.sandbox  # noqa: F401
        except ImportError:
            raise ChatTemplateError(f"{self.source}: rendering a chat template needs jinja2 "
                                    f"(pip install -e '.[kie]')") from None
        try:
            request = json.loads(json.dumps({"messages": list(messages),
                                             "add_generation_prompt": bool(add_generation_prompt)}))
        except (TypeError, ValueError) as e:
            raise ChatTemplateError(f"{self.source}: the messages are not plain JSON data: {e}") from None
        try:
            text = self._renderer().call(request, self.time_limit)
        except bounded.Overrun as e:
            raise ChatTemplateError(f"{self.source}: rendering the chat template was stopped: {e}") from None
        except bounded.Failed as e:
            if e.kind == "_CompileError":
                raise ChatTemplateError(f"{self.source}: the chat template does not compile: {e.text}") from None
            what = e.text if e.kind in ("TemplateError", "TemplateRuntimeError", "SecurityError",
                                        "UndefinedError") else f"{e.kind}: {e.text}"
            raise ChatTemplateError(f"{self.source}: rendering failed: {what}") from None
        if not isinstance(text, str):
            raise ChatTemplateError(f"{self.source}: rendering gave a {type(text).__name__}, not text")
        return text

    def encode(self, tokenizer, prompt):
        """Token ids of one user turn plus the assistant's generation prompt."""
        text = self.render([{"role": "user", "content": prompt}])
        return tokenizer.encode(text, add_special_tokens=False).ids

    def end_of_turn(self, tokenizer):
        """The id of the token that closes an assistant turn: the file's own eot id if it
        names one, else the special token the template writes right after an assistant
        message (found by rendering one), else None."""
        if self.eot_token_id is not None:
            return int(self.eot_token_id)
        try:
            text = self.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}],
                               add_generation_prompt=False)
        except ChatTemplateError:
            return None
        if _PROBE not in text:
            return None
        after = text.split(_PROBE, 1)[1]
        ids = tokenizer.encode(after, add_special_tokens=False).ids if after else []
        added = tokenizer.get_added_tokens_decoder()
        return ids[0] if ids and ids[0] in added and added[ids[0]].special else None


class _CompileError(Exception):
    pass


def _compile(text, special_tokens):
    """The render function of a template compiled as transformers compiles it (runs in the
    renderer process: compiling may fold constants without end)."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        template = env.from_string(text)
    except Exception as e:
        raise _CompileError(str(e)) from None

    def render(request):
        return template.render(messages=request["messages"], add_generation_prompt=request["add_generation_prompt"],
                               **special_tokens)
    return render
