"""`decodekit search` and `decodekit info`: finding methods on the Hub, and looking at one before trusting it
(hub_loader/discover.py holds what they read; nothing of a method is run)."""

from __future__ import annotations

import dataclasses
import json

from ..sizes import human_size


def cmd_search(args) -> int:
    from ..hub_loader.discover import search_methods

    found = search_methods(args.query, sort=args.sort, limit=args.limit)
    if args.json:
        print(json.dumps([dataclasses.asdict(item) for item in found], indent=2))
        return 0
    if not found:
        print(f"No Hub repository tagged custom_generate{f' matches {args.query!r}' if args.query else ''}.")
        return 0
    for item in found:
        changed = (item.last_modified or "")[:10] or "?"
        print(f"{item.id}  (changed {changed}, {item.downloads or 0} downloads, {item.likes or 0} likes)")
        if item.summary:
            print(f"    {item.summary}")
    print(f"\nLook at one before trusting it: decodekit info {found[0].id}")
    return 0


def cmd_info(args) -> int:
    from ..hub_loader.discover import describe_method

    info = describe_method(args.method, revision=args.revision)
    if args.json:
        print(json.dumps({**dataclasses.asdict(info), "commands": info.commands()}, indent=2))
        return 0
    print(f"{info.spec} ({'Hub repository' if info.kind == 'hub' else 'local directory'}); nothing of it was run")
    if info.summary:
        print(f"  card:         {info.summary}")
    if info.description:
        print(f"  generate.py:  {info.description}")
    if info.loop:
        print(
            f"  what it is:   a whole decoding loop (generate()); its arguments: {', '.join(info.arguments) or 'none'}"
        )
    else:
        print(f"  what it is:   hooks: {', '.join(info.hooks) or 'none found'}")
    print(f"  pin:          {info.pin}  ({'the commit' if info.kind == 'hub' else 'the content hash'} trust holds)")
    if info.requirements:
        print("  requirements:")
        for requirement, met in info.requirements:
            print(f"    {'met    ' if met else 'NOT MET'}  {requirement}")
    else:
        print("  requirements: none (no requirements.txt)")
    print("  files:")
    for name, size, sha in info.files:
        print(f"    {name}  {human_size(size)}  sha256 {sha}")
    print("  run it pinned to this revision:")
    for command in info.commands():
        print(f"    {command}")
    return 0
