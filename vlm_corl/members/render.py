"""The render phase: one example, in one member's view, through its prompt style, chat template and processor.

Images are decoded, brought to the size the model reads (`Member.prepare_image`: Qwen-VL's patch grid) and
preprocessed once per (member, example), and the processor's tensors are cached on the host, up to a byte
budget (a Qwen2.5-VL image at the default cap is ~24 MB of fp32 pixels), so later epochs and the update's
forward pass reuse them instead of preprocessing again.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from vlm_corl.data.images import load_image
from vlm_corl.data.records import Example, ViewError
from vlm_corl.errors import UserError
from vlm_corl.members.batching import remember_positions
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
    """A rendered prompt exceeds rollout.max_prompt_tokens (`tokens`: its length, `member`: whose prompt)."""

    def __init__(self, message: str, member: str = "", tokens: int = 0):
        super().__init__(message)
        self.member, self.tokens = member, tokens


@dataclass(frozen=True)
class Wording:
    """How a renderer words its member's prompts where that differs from the member's own config (None: the
    member's): a second view of the question (co_rewarding_1's second slot), another prompt style (a benchmark's)."""

    view: str | None = None  # original | paraphrase:K (members[i].view)
    style: str | None = None  # a key of PROMPT_STYLES (members[i].prompt_style, else the family's)


class Renderer:
    """Renders examples for one member; keeps an LRU cache of rendered prompts keyed by example id, holding at
    most `cache_bytes` of processor tensors (on the host: `Member.process`)."""

    def __init__(
        self,
        member,
        view_fallback: str,
        max_image_pixels: int,
        max_prompt_tokens: int,
        wording: Wording = Wording(),
        cache_bytes: int = 4 << 30,
    ):
        self.member = member
        self.style = wording.style or member.prompt_style  # the instruction after the question (PROMPT_STYLES)
        self.view = wording.view or member.cfg.view  # a member may be rendered in a second view (co_rewarding_1)
        self.view_fallback = view_fallback
        self.max_image_pixels = max_image_pixels
        self.max_prompt_tokens = max_prompt_tokens
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[str, tuple[Prompt, int]] = OrderedDict()
        self._cached_bytes = 0
        self.view_fallbacks = 0

    @property
    def cached_bytes(self) -> int:
        """Bytes of processor tensors the cache holds now."""
        return self._cached_bytes

    def cached_prompts(self) -> list[Prompt]:
        """The rendered prompts the cache holds now, least recently used first."""
        return [prompt for prompt, _ in self._cache.values()]

    def __call__(self, example: Example) -> Prompt:
        hit = self._cache.get(example.id)
        if hit is not None:
            self._cache.move_to_end(example.id)
            return hit[0]
        prompt = self.render(example)
        size = sum(t.numel() * t.element_size() for t in prompt.inputs.values())
        size += remember_positions(self.member.model, prompt.inputs, self.member.mrope)
        self._cache[example.id] = (prompt, size)
        self._cached_bytes += size
        while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
            _, (_, dropped) = self._cache.popitem(last=False)
            self._cached_bytes -= dropped
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
        images = [
            member.prepare_image(load_image(src, max_pixels=self.max_image_pixels), self.max_image_pixels)
            for src in example.images
        ]
        chat_text = member.apply_chat_template(text, len(images), member.cfg.system_prompt)
        inputs = member.process(chat_text, images)
        length = inputs["input_ids"].shape[1]
        if length > self.max_prompt_tokens:
            raise PromptTooLong(
                f"example {example.id!r} renders to {length} tokens for member {member.id!r}, over "
                f"the longest prompt allowed ({self.max_prompt_tokens} tokens: rollout.max_prompt_tokens in "
                "training, --max-prompt-tokens when evaluating with vLLM): raise it"
                + (" or lower data.max_image_pixels" if example.images else ""),
                member.id,
                length,
            )
        return Prompt(example.id, chat_text, images, inputs)
