"""A verifiers 0.4 environment with a conversation, for tests/test_verifiers_v04.py: the model answers a sum, the
environment asks it once more ("Sure?") and the second reply is scored. Two model calls in one trace without tools
(an `Env` of its own driving the agent turn by turn, as verifiers' user-sim env does), so verifiers' train client
continues the conversation token for token (its renderer bridges the next turn onto the previous ids) even
with the default renderer, which refuses tools. Imported in .venv-verifiers only, never by rlflow."""

import verifiers.v1 as vf


class ChatData(vf.TaskData):
    answer: str


class ChatTask(vf.Task[ChatData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == self.data.answer)

    @vf.metric
    async def turns(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)


class ChatTaskset(vf.Taskset[ChatTask, vf.TasksetConfig]):
    def load(self) -> list[ChatTask]:
        return [ChatTask(ChatData(prompt=f"{i}+{i}=", answer=str(2 * i)), self.config.task) for i in range(3)]


class ChatEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()


class ChatEnv(vf.Env[ChatEnvConfig]):
    """The prompted task speaks first (its opening reply), then one more user turn."""

    async def run(self, task, agents) -> None:
        async with agents.agent.interaction(task) as chat:
            first = await chat.turn()
            if not first.terminated:
                await chat.turn("Sure?")


__all__ = ["ChatEnv", "ChatTaskset"]
