"""A game of your own for two trained models: a teller and a listener (examples/game/README.md).

The teller answers the data set's prompt in a few characters. The listener, in a thread of
its own, sees only what the teller said (`echo:TOLD:`) and says it back. The teller is
rewarded for the share of digits it told (a skill of its own, the default task's), the
listener for the share of the teller's characters it repeated in place. Each thread is a
training row of the model that speaks in it, scored by the Outcome's reward for it; the
share of games echoed exactly is reported as `game/exact`.

    rollout:
      env: examples.game.echo:EchoGame   # importable from where `meshrl run` starts
      env_args: {length: 4}
    models:
      - name: teller

`from_config` gives the game the run's config, so that the model names are the config's
(`config.model_names()`: the policy first, then `models[*].name`), not written twice.
"""

from __future__ import annotations

from meshrl.rollout.game import Ask, Outcome, Reply


class EchoGame:
    def __init__(self, teller: str = "teller", listener: str = "policy", length: int = 4):
        self.teller, self.listener, self.length = teller, listener, length
        self.told = ""

    @classmethod
    def from_config(cls, config, **env_args) -> "EchoGame":
        """The game of a run: its first model beside the policy tells, the policy listens."""
        names = config.model_names()
        return cls(teller=names[1], listener=names[0], **env_args)

    def reset(self, sample: dict) -> Ask:
        return Ask(self.teller, "tell", sample["prompt"], max_new_tokens=self.length)

    def step(self, reply: Reply) -> Ask | Outcome:
        if reply.thread == "tell":  # the listener's turn, in a thread of its own
            self.told = reply.text[: self.length]
            return Ask(self.listener, "echo", f"echo:{self.told}:", max_new_tokens=max(1, len(self.told)))
        told, heard = self.told, reply.text
        digits = sum(ch.isdigit() for ch in told) / self.length
        echoed = sum(a == b for a, b in zip(told, heard)) / len(told) if told else 0.0
        return Outcome({"tell": digits, "echo": echoed}, info={"exact": float(bool(told) and heard[: len(told)] == told)})  # game/exact
