"""The front-end check calibrated on AWS's shipped kernels (issue 20 item 4): the constructs
AWS's MXFP8 MoE backward uses are accepted, host-side construction is told apart from traced
code, and the rules upstream never breaks still reject (at the marked lines)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import numpy as np
import pytest

from mxcli.nkisim import Rule, check_frontend
from tests.nkisim import frontend_kernels as fk
from tests.nkisim import frontend_upstream_kernels as uk

X = np.ones((1, 1), np.float32)


def _marked(rule: str) -> set[int]:
    path = inspect.getsourcefile(uk)
    assert path is not None
    return {
        i
        for i, line in enumerate(Path(path).read_text().splitlines(), start=1)
        if re.search(rf"# violates: {rule}\b", line)
    }


def test_property_methods_are_accepted_and_classmethod_still_rejected() -> None:
    assert check_frontend(fk.good_property) == ()
    (v,) = [v for v in check_frontend(fk.bad_decorator) if v.rule is Rule.DECORATOR]
    assert "@classmethod" in v.message


def test_helper_decorators_are_ignored_and_the_wrapped_function_checked() -> None:
    # the wrapper's try/finally and *args are not traced (the front end ignores decorators)
    assert check_frontend(uk.decorated_helper_kernel) == ()
    found = check_frontend(uk.decorated_bad_helper_kernel)
    assert [(v.rule, v.line) for v in found] == [(Rule.SET, min(_marked("set")))]


def test_config_passed_as_argument_runs_its_construction_on_the_host() -> None:
    cfg = uk.BwdLikeConfig()
    assert cfg.total_tiles == 2
    assert check_frontend(uk.config_argument_kernel, (X, cfg)) == ()
    assert check_frontend(uk.host_only_argument_kernel, (X, uk.HostOnly())) == ()


def test_config_built_while_tracing_has_its_post_init_checked() -> None:
    # getattr / setattr / raise TypeError in __post_init__, zip and default_factory: accepted
    assert check_frontend(uk.config_built_in_kernel) == ()
    # construction code outside the subset is rejected once traced code builds the class
    rules = {v.rule for v in check_frontend(uk.host_only_built_in_kernel)}
    assert Rule.TRY in rules


def test_raise_outside_post_init_is_still_rejected_at_its_line() -> None:
    found = check_frontend(uk.config_method_raise_kernel, (X, uk.CheckedConfig()))
    assert [(v.rule, v.line) for v in found] == [(Rule.RAISE, min(_marked("raise")))]


@pytest.mark.parametrize("name", ["zip", "getattr", "setattr"])
def test_builtins_of_upstream_mxfp8_code_are_allowed(name: str) -> None:
    from mxcli.nkisim.frontend import ALLOWED_BUILTINS

    assert name in ALLOWED_BUILTINS
    assert "enumerate" not in ALLOWED_BUILTINS  # upstream never uses it: still rejected
