"""
The C{vllm} back end: OpenAI-compatible, so everything but the type and
the C{models} command is inherited from L{OpenAICompatAdapter}.

What vLLM adds is already read by the shared parser: reasoning text in
C{delta.reasoning_content} (or C{delta.reasoning} in newer releases), and
the usage breakdown C{prompt_tokens_details.cached_tokens} (with
C{--enable-prompt-tokens-details}) and
C{completion_tokens_details.reasoning_tokens} when it reports them. This
class exists so that operators can say C{type: vllm} and so that vLLM's
model list is one node command away.
"""

from dataclasses import replace
from typing import Any

from twisted.internet.defer import Deferred
from zope.interface import implementer

from iop.adapters.interface import Capabilities, IAdapter, Progress
from iop.adapters.openai_compat import OpenAICompatAdapter


@implementer(IAdapter)
class VLLMAdapter(OpenAICompatAdapter):
    """
    Options as for C{openai_compat}; C{base_url} is vLLM's C{.../v1}.
    Commands: C{models} (C{GET {base_url}/models}, vLLM's served models).
    """

    type = "vllm"

    def capabilities(self) -> Capabilities:
        caps = super().capabilities()
        return replace(caps, commands=("models", *caps.commands))

    def continue_options(self) -> dict[str, Any]:
        """
        vLLM continues the last assistant message with these.
        """
        return {"continue_final_message": True, "add_generation_prompt": False}

    def command(self, name: str, args: dict[str, Any], progress: Progress | None = None) -> "Deferred[Any]":
        if name == "models":
            return self.fetch_json("GET", "/models")
        return super().command(name, args)
