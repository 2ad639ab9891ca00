"""Errors of the planning core: every problem names the offending field by its path."""

from __future__ import annotations

from dataclasses import dataclass

Loc = tuple[str | int, ...]


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with an input: where (``loc``), what (``message``) and a stable ``code``."""

    loc: Loc
    message: str
    code: str = "invalid_page_table"

    def to_dict(self) -> dict[str, object]:
        return {"loc": list(self.loc), "msg": self.message, "code": self.code}


class GeometryError(ValueError):
    """Input the planning core refuses; ``problems`` lists every reason found, not just one."""

    def __init__(self, problems: list[Problem] | Problem) -> None:
        self.problems = [problems] if isinstance(problems, Problem) else list(problems)
        first = self.problems[0] if self.problems else Problem((), "invalid input")
        more = f" (+{len(self.problems) - 1} more)" if len(self.problems) > 1 else ""
        where = ".".join(str(part) for part in first.loc)
        super().__init__(f"{where}: {first.message}{more}" if where else first.message + more)

    @classmethod
    def single(cls, loc: Loc, message: str, code: str = "invalid_page_table") -> GeometryError:
        return cls(Problem(loc, message, code))

    @property
    def code(self) -> str:
        """The code of the first problem (the one a caller most likely wants to branch on)."""
        return self.problems[0].code if self.problems else "invalid_page_table"


class ProblemSink:
    """Collects problems while a parser walks an input, then raises them all at once."""

    def __init__(self) -> None:
        self.problems: list[Problem] = []

    def add(self, loc: Loc, message: str, code: str = "invalid_page_table") -> None:
        self.problems.append(Problem(loc, message, code))

    def raise_if_any(self) -> None:
        if self.problems:
            raise GeometryError(self.problems)
