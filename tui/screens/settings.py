"""The settings screen, generated from the settings schema.

Every key of every section gets a widget chosen from its FieldSpec (Switch for booleans,
Select for choices, Input for numbers and free text) and its help text. The Inputs check
their text with the same `coerce` the settings file goes through, and the cross-field rules
run on every change, so the screen marks what loading the file would refuse, and also keys
the prompt would keep from the app.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.content import Content
from textual.screen import ModalScreen
from textual.validation import ValidationResult, Validator
from textual.widget import Widget
from textual.widgets import Button, Input, Label, Select, Static, Switch

from kvchat.config import ConfigError, FieldSpec, KeySettings, Settings, changed_keys, save_changes
from kvchat.config.schema import schema_fields, sections
from kvchat.config.validate import Invalid, Problem, coerce, rule_problems
from kvchat.core.engine import setting_effect

from ..widgets.prompt import PromptInput
from .load_file import home_relative

EFFECT_NOTES = {
    "live": "",
    "cache": " Changing it needs a new cache: the context is prefilled again.",
    "reload": " Changing it needs the model loaded again: restart kvchat or use /model.",
}


def prompt_clashes(keys: KeySettings) -> list[Problem]:
    """Keys the prompt has a use for: pressed while it has the focus, they never reach the
    app. (The app's bindings cannot be priority ones: those fire inside dialogs too, and Esc
    would stop a reply instead of closing the dialog.)"""
    taken = {
        key: binding.description
        for binding in PromptInput.BINDINGS
        if isinstance(binding, Binding)
        for key in binding.key.split(",")
    }
    return [
        Problem(f"keys.{action}", value, f"a key the prompt does not use ({key}: {taken[key]})")
        for action, value in vars(keys).items()
        for key in (name.strip() for name in value.split(","))
        if key in taken
    ]


def widget_id(key: str) -> str:
    return key.replace(".", "--")


def parse_value(spec: FieldSpec, key: str, text: str) -> Any:
    """The typed value of an Input's text, or raise Invalid naming what is allowed."""
    value: Any = text
    if spec.type in (int, float):
        try:
            value = spec.type(text.strip())
        except ValueError:
            raise Invalid(Problem(key, text, spec.allowed(), got="not a number")) from None
    return coerce(spec, key, value)


class SchemaValidator(Validator):
    """An Input's text checked against its FieldSpec."""

    def __init__(self, spec: FieldSpec, key: str) -> None:
        super().__init__()
        self.spec, self.key = spec, key

    def validate(self, value: str) -> ValidationResult:
        try:
            parse_value(self.spec, self.key, value)
        except Invalid as e:
            return self.failure(str(e.problem))
        return self.success()


def field_widget(spec: FieldSpec, key: str, value: Any) -> Widget:
    if spec.type is bool:
        return Switch(value, id=widget_id(key))
    if spec.choices is not None:
        options = [(choice.value, choice) for choice in spec.choices]
        return Select(options, value=value, allow_blank=False, id=widget_id(key))
    return Input(str(value), validators=[SchemaValidator(spec, key)], id=widget_id(key))


class SettingsScreen(ModalScreen[Settings | None]):
    """Edits `settings`; Save writes the changed keys to `path` and dismisses with the new
    settings, Esc dismisses with None."""

    BINDINGS = [
        Binding("escape", "close", "Close"),
        Binding("ctrl+s", "save", "Save"),
    ]

    def __init__(self, settings: Settings, path: Path) -> None:
        super().__init__()
        self.settings, self.path = settings, path

    def compose(self) -> ComposeResult:
        with Vertical(id="settings-dialog") as dialog:
            # Content, not a str: a str title is read as markup, and the path is the user's.
            dialog.border_title = Content(f"Settings: {home_relative(self.path)}")
            with VerticalScroll(id="settings-form"):
                for section, cls, help in sections():
                    yield Static(f"[b]{section}[/b]  {help}", classes="settings-section")
                    for spec in schema_fields(cls):
                        key = f"{section}.{spec.name}"
                        value = getattr(getattr(self.settings, section), spec.name)
                        with Horizontal(classes="setting", id=f"row-{widget_id(key)}"):
                            yield Label(spec.name, classes="setting-name")
                            yield field_widget(spec, key, value)
                        note = spec.help + EFFECT_NOTES[setting_effect(key)]
                        yield Static(note, markup=False, classes="setting-help")
            yield Static(id="settings-message", markup=False)
            with Horizontal(id="settings-buttons"):
                yield Button("Save", variant="primary", id="settings-save")
                yield Button("Cancel", id="settings-cancel")

    def read(self) -> tuple[Settings | None, list[Problem]]:
        """The settings the form holds, or None and what is wrong with them."""
        problems: list[Problem] = []
        built = {}
        for section, cls, _ in sections():
            values = {}
            for spec in schema_fields(cls):
                key = f"{section}.{spec.name}"
                widget = self.query_one(f"#{widget_id(key)}")
                if not isinstance(widget, Input):
                    values[spec.name] = widget.value  # type: ignore[attr-defined]
                    continue
                try:
                    values[spec.name] = parse_value(spec, key, widget.value)
                except Invalid as e:
                    problems.append(e.problem)
            built[section] = values
        if problems:
            return None, problems
        settings = Settings(**{name: cls(**built[name]) for name, cls, _ in sections()})
        problems = rule_problems(settings) + prompt_clashes(settings.keys)
        return (None if problems else settings), problems

    def check(self, prefix: str = "") -> Settings | None:
        """Mark the rows of invalid keys and list the problems (after `prefix`, if any);
        the valid settings, or None."""
        settings, problems = self.read()
        bad = {f"row-{widget_id(problem.key)}" for problem in problems}
        for row in self.query(".setting"):
            row.set_class(row.id in bad, "invalid")
        lines = [prefix] if problems and prefix else []
        self.query_one("#settings-message", Static).update(
            "\n".join(lines + list(map(str, problems)))
        )
        return settings

    def on_input_changed(self) -> None:
        self.check()

    def on_select_changed(self) -> None:
        self.check()

    def on_switch_changed(self) -> None:
        self.check()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        if event.button.id == "settings-save":
            self.action_save()
        else:
            self.action_close()

    def action_save(self) -> None:
        settings = self.check(prefix="Not saved: fix the marked settings.")
        if settings is None:
            return
        if not changed_keys(self.settings, settings):
            self.dismiss(None)
            return
        try:
            save_changes(self.path, self.settings, settings)
        except (ConfigError, OSError) as e:
            self.query_one("#settings-message", Static).update(f"Not saved: {e}")
            return
        self.dismiss(settings)

    def action_close(self) -> None:
        self.dismiss(None)
