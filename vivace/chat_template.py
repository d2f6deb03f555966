"""``--chat-template``: a Jinja chat template that replaces the tokenizer's, given as vLLM takes it."""

from __future__ import annotations

from pathlib import Path

# A value with none of these is a file's path, never a template (vLLM's rule).
_TEMPLATE_CHARS = "{}\n"


def read_chat_template(value: str) -> str:
    """The template ``value`` stands for: the text of the file it names, else ``value`` itself with
    its backslash escapes (``\\n``) decoded, as vLLM reads it. Raises ValueError naming the flag for a
    path that cannot be read or a template that does not compile."""
    source = f"--chat-template {value}"
    try:
        template = Path(value).expanduser().read_text(encoding="utf-8")
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the value
        if not any(char in value for char in _TEMPLATE_CHARS):
            reason = getattr(exc, "strerror", None) or exc
            raise ValueError(f"{source}: looks like a file's path, but it cannot be read "
                             f"({reason})") from None
        template = value.encode("latin-1", "backslashreplace").decode("unicode_escape")
        source = "--chat-template (inline)"
    check_compiles(template, source)
    return template


def check_compiles(template: str, source: str) -> None:
    """Raise ValueError naming ``source`` when ``template`` is not Jinja that transformers compiles."""
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template  # transformers' own environment

    try:
        _compile_jinja_template(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"{source}: the template does not compile: {exc.message} "
                         f"(line {exc.lineno})") from None
