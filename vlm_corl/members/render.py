"""The render phase: one example, in one member's view, through its prompt style, chat template and processor.

Images are decoded and preprocessed once per (member, example) and cached, so later epochs and the update's
forward pass reuse the processor's tensors instead of preprocessing again.
"""

from __future__ import annotations

from collections import OrderedDict

from vlm_corl.data.images import load_image
from vlm_corl.data.records import Example, ViewError
from vlm_corl.errors import UserError
from vlm_corl.members.rollout import Prompt

# The instruction each prompt style appends to the question (docs/method.md: the paper's prompts).
PROMPT_STYLES = {
    "boxed": "{question}\nLet's think step by step and output the final answer within \\boxed{{}}.",
    "answer_tags": (
        "{question}\nFirst think about the question inside <think> </think> tags, "
        "then give the final answer inside <answer> </answer> tags."
    ),
    # Code benchmarks: the program is graded by running it, so the answer is a code block.
    "code": "{question}\nWrite your solution as one Python code block (```python ... ```).",
}


class PromptTooLong(UserError, ValueError):
    """A rendered prompt exceeds rollout.max_prompt_tokens."""


class Renderer:
    """Renders examples for one member; keeps an LRU cache of rendered prompts keyed by example id."""

    CACHE_SIZE = 8192  # rendered prompts kept (least recently used dropped)

    def __init__(
        self,
        member,
        view_fallback: str,
        max_image_pixels: int,
        max_prompt_tokens: int,
        view: str | None = None,
        style: str | None = None,
    ):
        self.member = member
        self.style = style or member.prompt_style  # the instruction after the question (PROMPT_STYLES)
        self.view = view or member.cfg.view  # a member may be rendered in a second view (co_rewarding_1)
        self.view_fallback = view_fallback
        self.max_image_pixels = max_image_pixels
        self.max_prompt_tokens = max_prompt_tokens
        self._cache: OrderedDict[str, Prompt] = OrderedDict()
        self.view_fallbacks = 0

    def __call__(self, example: Example) -> Prompt:
        hit = self._cache.get(example.id)
        if hit is not None:
            self._cache.move_to_end(example.id)
            return hit
        prompt = self.render(example)
        self._cache[example.id] = prompt
        if len(self._cache) > self.CACHE_SIZE:
            self._cache.popitem(last=False)
        return prompt

    def render(self, example: Example) -> Prompt:
        """Build the chat-templated prompt text and its processor tensors (uncached)."""
        member = self.member
        try:
            question = example.question_for(self.view)
        except ViewError:
            if self.view_fallback != "original":
                raise
            question = example.question
            self.view_fallbacks += 1  # counted in the run log (data.view_fallback=original)
        text = PROMPT_STYLES[self.style].format(question=question)
        images = [load_image(src, max_pixels=self.max_image_pixels) for src in example.images]
        chat_text = member.apply_chat_template(text, len(images), member.cfg.system_prompt)
        inputs = member.process(chat_text, images)
        length = inputs["input_ids"].shape[1]
        if length > self.max_prompt_tokens:
            raise PromptTooLong(
                f"example {example.id!r} renders to {length} tokens for member {member.id!r}, over "
                f"the longest prompt allowed ({self.max_prompt_tokens} tokens: rollout.max_prompt_tokens in "
                "training, --max-prompt-tokens when evaluating with vLLM): raise it"
                + (" or lower data.max_image_pixels" if example.images else "")
            )
        return Prompt(example.id, chat_text, images, inputs)
