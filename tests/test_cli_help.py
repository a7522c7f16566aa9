"""Every flag of every `dflash-jax` command says what it does and what it defaults to."""

from __future__ import annotations

import argparse

import pytest

from dflash_jax import cli


def commands() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {"dflash-jax": parser, **subparsers.choices}


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("name, parser", commands().items())
def test_every_flag_has_help_that_says_its_default_once(name, parser):
    formatter = parser._get_formatter()
    for action in options(parser):
        flag = action.option_strings[-1]
        assert action.help and action.help.strip(), f"{name} {flag} has no help"
        shown = formatter._expand_help(action)
        assert shown.count("default") <= 1 and "(default: None)" not in shown, f"{name} {flag}: {shown}"
        if action.default not in (None, False):  # a value to show, not a switch or a default computed later
            assert "default" in shown, f"{name} {flag} does not say its default: {shown}"


def test_serve_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal's width
    assert "port to listen on (0: any free one) (default: 8000)" in text
    assert "(default: 127.0.0.1)" in text
