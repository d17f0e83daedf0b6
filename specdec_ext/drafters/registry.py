"""The drafters by name, as `--drafter` spells them: each drafter's file registers a DrafterEntry (its spelling, how
the value after the colon is read and checked, how it is built, its help line and what it needs), and everything
that names drafters reads this table: factory.check_drafter / make_drafter, the commands' flags, help and checks, the
demo, train-draft, the benchmarks and every message that lists them. A new drafter is its file, with its
register_drafter call at the end, imported by specdec_ext/drafters/__init__.py as every drafter is (to export it).

A spec is NAME or NAME:VALUE (lookahead:7/5/7, model:PATH, eagle:PATH). Listed in name order, whatever the order the
files are imported in. Importing this module imports specdec_ext.drafters first (Python runs a package's
__init__ before its submodules), which imports every drafter file: the table is full once this module is.
"""
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .base import Drafter


@dataclass(frozen=True)
class DrafterEntry:
    """One drafter as the command line knows it."""
    name: str                 # what a spec starts with
    drafter_class: type       # its Drafter subclass: draws_trees and runs_own_trees read its class attributes
    syntax: str               # its spelling in help and messages: ngram, lookahead[:W/N/G], model:PATH, eagle[:PATH]
    help: str                 # what it is, a noun phrase: "n-gram prompt lookup", "a draft model"
    parse: Callable           # parse(spec, value) -> build's keyword arguments; value: the text after the colon
    #                           (None: no colon). Raises ValueError (syntax, a PATH that does not exist, settings the
    #                           drafter refuses) and loads nothing: the command checks it before loading the model
    build: Callable           # build(target, **arguments) -> the Drafter; with needs_draft_model also keep_quantized=
    value_help: str = ""      # what the value after the colon is, when the help line needs to say it
    trained_heads: bool = False  # weights made by `specdec train-draft --kind NAME`; without a value, those shipped
    #                              for the default model (refused for any other target)
    needs_draft_model: bool = False  # a second model, loaded by build (--draft-keep-quantized applies to it)
    drafts_from_the_text: bool = False  # drafts from the request's own tokens, no model (the demo's rewriting task)

    @property
    def draws_trees(self) -> bool:
        """Tree rounds (--tree) can be drafted by it."""
        return self.drafter_class.supports_trees

    @property
    def runs_own_trees(self) -> bool:
        """Its rounds are trees of its own sizing, with or without --tree (Lookahead)."""
        return self.drafter_class.sizes_own_tree

    def help_line(self) -> str:
        """`syntax (help; value_help)`: its part of --drafter's help."""
        return f"{self.syntax} ({self.help}{'; ' + self.value_help if self.value_help else ''})"


DRAFTERS: dict = {}  # name -> DrafterEntry


def register_drafter(entry: DrafterEntry) -> DrafterEntry:
    """Adds a drafter to the table (its file calls this once, when imported)."""
    if not isinstance(entry.drafter_class, type) or not issubclass(entry.drafter_class, Drafter):
        raise ValueError(f"register_drafter: {entry.name}'s drafter_class must be a Drafter subclass, got "
                         f"{entry.drafter_class!r}")
    if not entry.name or not entry.name.isidentifier():
        raise ValueError(f"register_drafter: a drafter's name must be a word (the part of a spec before its colon), "
                         f"got {entry.name!r}")
    if entry.name in DRAFTERS:
        raise ValueError(f"register_drafter: a drafter named {entry.name!r} is registered already")
    DRAFTERS[entry.name] = entry
    return entry


def drafters() -> list:
    """Every registered DrafterEntry, in name order."""
    return [DRAFTERS[name] for name in sorted(DRAFTERS)]


def spelled(words: list) -> str:
    """'a', 'a or b', 'a, b or c'."""
    return " or ".join(filter(None, (", ".join(words[:-1]), words[-1] if words else "")))


def bad_spec(spec: str) -> ValueError:
    """The message for a spec that no drafter reads: every drafter's spelling."""
    return ValueError(f"--drafter must be {spelled([e.syntax for e in drafters()])}, got {spec!r}")


def drafter_entry(spec: str) -> DrafterEntry:
    """The entry of the drafter a spec names (its syntax and values not checked: parse_drafter does)."""
    entry = DRAFTERS.get(spec.partition(":")[0])
    if entry is None:
        raise bad_spec(spec)
    return entry


def parse_drafter(spec: str, for_the_default_model: Callable) -> tuple:
    """(entry, build's keyword arguments) of a spec, checked before anything loads: ValueError when the spec is not
    one a drafter reads, or (trained_heads without a value) when for_the_default_model(), asked only then, says the
    target is not the model whose heads ship."""
    entry = drafter_entry(spec)
    _, colon, value = spec.partition(":")
    arguments = entry.parse(spec, value if colon else None)
    if entry.trained_heads and not colon and not for_the_default_model():
        raise ValueError(f"--drafter {entry.name}: heads ship for the default model only; give {entry.name}:PATH, "
                         f"made by `specdec train-draft --kind {entry.name}`")
    return entry, arguments


# What drafters' parse functions share.

def no_value(spec: str, value: str | None) -> dict:
    """parse of a drafter without settings: NAME alone."""
    if value is not None:
        raise bad_spec(spec)
    return {}


def path_value(spec: str, value: str | None, *, required: bool) -> str | None:
    """The PATH of NAME:PATH, which must exist (None: NAME alone, when the PATH is optional)."""
    if value is None and not required:
        return None
    if not value:
        raise bad_spec(spec)
    if not Path(value).exists():
        raise ValueError(f"--drafter {spec}: no such file or directory")
    return value
