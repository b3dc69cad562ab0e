"""``tokenline bench serve --workload multiturn``: chats that share system prompts and grow by turns.

G groups each have their own system prompt; conversations are spread evenly over the groups (in a
shuffled order, so that group and arrival order do not line up with a round-robin router). Every
turn appends a fresh user message and the model's actual previous answers, so a later turn's
prompt starts with everything its conversation sent before: the prefix cache of the replica that
served the earlier turns can skip it, and the group's system prompt is shared across conversations.
This is the workload on which routing policies differ (affinity keeps a conversation's prefix hot).

Construction is deterministic from the seed and needs no server; ``run_conversations`` runs the
conversations through any ``send`` function, turns of one conversation in order.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from tokenline.bench.results import RequestResult

Message = dict[str, str]


@dataclass(frozen=True)
class Conversation:
    conversation_id: str  # sent as the request's ``user``, so session affinity can follow it
    group: int
    user_messages: tuple[str, ...]  # one per turn


@dataclass(frozen=True)
class MultiturnWorkload:
    system_prompts: tuple[str, ...]  # one per group
    conversations: tuple[Conversation, ...]

    @property
    def turns(self) -> int:
        return len(self.conversations[0].user_messages) if self.conversations else 0

    def messages(self, conversation: Conversation, answers: Sequence[str]) -> list[Message]:
        """The chat for turn ``len(answers)``: the group's system prompt, each earlier user message
        followed by the model's answer to it, then this turn's user message."""
        turn = len(answers)
        if turn >= len(conversation.user_messages):
            raise ValueError(f"{conversation.conversation_id} has {len(conversation.user_messages)} turns, "
                             f"not {turn + 1}")
        chat: list[Message] = [{"role": "system", "content": self.system_prompts[conversation.group]}]
        for user, answer in zip(conversation.user_messages, answers):
            chat += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        chat.append({"role": "user", "content": conversation.user_messages[turn]})
        return chat


def make_multiturn_workload(
    *,
    num_groups: int,
    num_conversations: int,
    turns: int,
    system_prompt_len: int,
    input_len: int,
    ordinary_ids: Sequence[int],
    decode: Callable[[list[int]], str],
    seed: int,
) -> MultiturnWorkload:
    """System prompts of ``system_prompt_len`` random ordinary ids and user messages of
    ``input_len``, decoded to text (so lengths in tokens are approximate, as for chat prompts)."""
    if min(num_groups, num_conversations, turns, system_prompt_len, input_len) < 1:
        raise ValueError("num_groups, num_conversations, turns, system_prompt_len and input_len must be >= 1")
    if not ordinary_ids:
        raise ValueError("no ordinary token ids to draw from")
    rng = random.Random(seed)
    systems = tuple(decode(rng.choices(ordinary_ids, k=system_prompt_len)) for _ in range(num_groups))
    groups = [c % num_groups for c in range(num_conversations)]
    rng.shuffle(groups)
    width = len(str(num_conversations - 1))
    conversations = tuple(
        Conversation(
            conversation_id=f"conv-{seed}-{c:0{width}d}",
            group=groups[c],
            user_messages=tuple(decode(rng.choices(ordinary_ids, k=input_len)) for _ in range(turns)),
        )
        for c in range(num_conversations)
    )
    return MultiturnWorkload(systems, conversations)


@dataclass
class TurnResult:
    conversation: int  # index into the workload's conversations
    turn: int
    result: RequestResult


# (conversation, turn index, chat so far) -> the request's result, with ``text`` its answer.
TurnSender = Callable[[Conversation, int, list[Message]], Awaitable[RequestResult]]


async def run_conversations(workload: MultiturnWorkload, send: TurnSender, max_concurrency: int) -> list[TurnResult]:
    """Every conversation's turns in order, at most ``max_concurrency`` conversations at a time
    (so at most that many requests in flight). A failed turn ends its conversation: the later
    turns cannot be built, and are reported failed without being sent."""
    if max_concurrency < 1:
        raise ValueError("max_concurrency must be >= 1")
    results: list[TurnResult] = []
    next_index = 0

    async def worker() -> None:
        nonlocal next_index
        while next_index < len(workload.conversations):
            c = next_index  # one event loop: taking the next index needs no lock
            next_index += 1
            conversation = workload.conversations[c]
            answers: list[str] = []
            for turn in range(len(conversation.user_messages)):
                result = await send(conversation, turn, workload.messages(conversation, answers))
                results.append(TurnResult(c, turn, result))
                if not result.success:
                    for later in range(turn + 1, len(conversation.user_messages)):
                        skipped = RequestResult(prompt_len=0, error=f"not sent: turn {turn + 1} failed")
                        results.append(TurnResult(c, later, skipped))
                    break
                answers.append(result.text)

    await asyncio.gather(*(worker() for _ in range(min(max_concurrency, len(workload.conversations)))))
    return results
