"""The distbench CLI after the circle was broken: ``repeat`` parses each variant with the ``run`` parser of
``load_args`` (bad arguments: exit 2 naming the variant), and ``distbench.cli`` still offers ``options_from``."""

from __future__ import annotations

from distserve.distbench import cli, load_args
from distserve.distbench.cli import main


def test_repeat_refuses_a_variant_that_is_not_run_arguments(tmp_path, capsys):
    code = main(["repeat", "1", "--out-dir", str(tmp_path), "--variant", "A=--request-rate fast --url http://x"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--variant A: not valid arguments of distbench run" in err and "distbench run: error" in err
    assert main(["repeat", "1", "--out-dir", str(tmp_path), "--variant", "A=--url http://x --save-result r"]) == 2
    assert "leave out --save-result" in capsys.readouterr().err


def test_the_run_arguments_parse_into_options_the_same_from_every_entry():
    argv = ["--url", "http://127.0.0.1:9/v1/completions", "--request-rate", "4", "--num-prompts", "7"]
    opts = load_args.options_from(load_args.run_parser().parse_args(argv))
    via_cli = cli.options_from(cli.build_parser().parse_args(["run", *argv]))
    assert opts.spec == via_cli.spec and opts.spec.url == "http://127.0.0.1:9" and opts.spec.num_prompts == 7
    assert load_args.base("https://h:1/generate") == "https://h:1"
