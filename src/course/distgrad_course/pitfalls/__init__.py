"""Deterministic reproductions of the mistakes the lessons are about.

Each module holds one pitfall and a `reproduce(...)` that runs it and returns a small
record of what happened: the exception (type and message) or the wrong numbers next
to the right ones. Lessons print and assert these records; tests assert the same.
Besides them: `question_mask_patch`, a question's patch that several reproductions run,
and `tf_keras_*`, the tf-keras programs run in a child process.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class CapturedError:
    """An exception a pitfall raised: its type name and message."""

    type: str
    message: str

    @classmethod
    def of(cls, error: BaseException) -> "CapturedError":
        return cls(type(error).__name__, str(error))

    def contains(self, fragment: str) -> bool:
        return fragment in self.message
