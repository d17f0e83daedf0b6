"""`specdec demo`: the command of specdec_ext/demo.py (what `bash scripts/demo.sh` runs)."""
from .. import demo
from ..drafters.registry import spelled
from .common import tree_settings


def register(sub) -> None:
    p = sub.add_parser("demo", help="the ops end to end, and the shipped model speculative against plain")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    names = demo.demo_drafters()
    chat = spelled([name for name in names if demo.task_of(name) == "chat"])
    rewrite = spelled([name for name in names if demo.task_of(name) == "rewrite"])
    p.add_argument("--drafter", default=None, choices=names,
                   help=f"run one task with this drafter: {chat} on the chat question, {rewrite} on the rewriting "
                        f"task (default: both tasks, each with the drafter the rule gives it)")
    p.add_argument("--tree", default=None, type=tree_settings,
                   help="tree rounds: N (nodes per tree) or nodes=N,depth=D,branching=K")
    # demo.main looked up when the command runs, so that a test can replace it first.
    p.set_defaults(fn=lambda args: demo.main(device=args.device, drafter=args.drafter, tree=args.tree))
