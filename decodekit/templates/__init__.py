"""Cookiecutter templates for authoring a method: `hub-repo` (a custom_generate repository) and
`plugin-package` (a pip-installable plugin). Snippets both use live in shared-snippets/: a name no import can
take, so packaging keeps it as data without a warning."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

TEMPLATES_DIR = Path(__file__).parent
TEMPLATES = ("hub-repo", "plugin-package")


def template_choices(template: str) -> dict:
    return json.loads((TEMPLATES_DIR / template / "cookiecutter.json").read_text())


def render(template: str, output_dir: Path, context: dict | None = None, no_input: bool = False, force: bool = False) -> Path:
    """Renders `template` into output_dir; returns the new project's directory.

    Refuses to write into an existing project directory unless `force` (then files of the same name
    are overwritten and other files are left alone).
    """
    from cookiecutter.exceptions import OutputDirExistsException
    from cookiecutter.main import cookiecutter

    if template not in TEMPLATES:
        raise ValueError(f"template={template!r} is unknown; choose one of {list(TEMPLATES)}.")
    context = {k: v for k, v in (context or {}).items() if v is not None}
    choices = template_choices(template)["hook_point"]
    if "hook_point" in context and context["hook_point"] not in choices:
        raise ValueError(f"hook_point={context['hook_point']!r} is invalid for {template}; choose one of {choices}.")
    output_dir = Path(output_dir)
    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / template
        shutil.copytree(TEMPLATES_DIR / template, staged)
        # cookiecutter's Jinja loader looks for {% include %} files in <template>/templates/.
        shutil.copytree(TEMPLATES_DIR / "shared-snippets", staged / "templates")
        config = {"cookiecutters_dir": str(Path(tmp) / "cc"), "replay_dir": str(Path(tmp) / "replay")}
        try:
            out = cookiecutter(str(staged), no_input=no_input, extra_context=context, output_dir=str(output_dir),
                               overwrite_if_exists=force, default_config=config)
        except OutputDirExistsException as e:
            raise FileExistsError(f"{str(e).removeprefix('Error: ')}; nothing was written. Choose another --name or -o, or pass --force to overwrite.") from None
    return Path(out)
