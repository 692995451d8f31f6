"""Chat templates: the jinja2 template a model ships (GGUF metadata
`tokenizer.chat_template`, or a Hugging Face directory's chat_template.jinja /
tokenizer_config.json) rendered the way transformers' `apply_chat_template(messages,
add_generation_prompt=True)` renders it: a sandboxed environment with trim_blocks and
lstrip_blocks, the loop-controls extension, a `tojson` that keeps non-ASCII text,
`raise_exception` and `strftime_now`, and the special tokens (bos_token, eos_token, ...)
as variables.  The rendered text is then tokenized without adding BOS/EOS (the template
writes whatever special tokens it wants)."""
import json
from datetime import datetime

from .errors import ConfigError

# A piece of text no template contains: rendering an assistant turn around it shows what
# the template writes after a turn (its end-of-turn token).
_PROBE = "KIE-END-OF-TURN-PROBE"


class ChatTemplateError(ConfigError):
    """The chat template does not compile or fails while rendering."""


class ChatTemplate:
    def __init__(self, text, special_tokens=None, source="chat template", eot_token_id=None):
        self.text, self.source = text, source
        self.special_tokens = dict(special_tokens or {})
        self.eot_token_id = eot_token_id
        self._compiled = None

    def _template(self):
        if self._compiled is None:
            try:
                import jinja2
                from jinja2.ext import loopcontrols
                from jinja2.sandbox import ImmutableSandboxedEnvironment
            except ImportError:
                raise ChatTemplateError(f"{self.source}: rendering a chat template needs jinja2 "
                                        f"(pip install -e '.[kie]')") from None

            def raise_exception(message):
                raise jinja2.exceptions.TemplateError(message)

            def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
                return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                                  sort_keys=sort_keys)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
            env.filters["tojson"] = tojson
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            try:
                self._compiled = env.from_string(self.text)
            except jinja2.exceptions.TemplateError as e:
                raise ChatTemplateError(f"{self.source}: the chat template does not compile: {e}") from None
        return self._compiled

    def render(self, messages, add_generation_prompt=True):
        """The prompt text of a conversation ([{'role', 'content'}, ...])."""
        import jinja2
        try:
            return self._template().render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                           **self.special_tokens)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"{self.source}: rendering failed: {e}") from None

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
