"""Argument checks: each bad argument named, with the public function's name, in one wording."""

from __future__ import annotations

import pytest
import torch

import freplicate as fr
from freplicate import _checks


@pytest.mark.parametrize(
    "value, error, text",
    [
        ("0", TypeError, r"^fr\.scatter: dim must be an int, got '0' of type str$"),
        (1.0, TypeError, r"^fr\.scatter: dim must be an int, got 1\.0 of type float$"),
        (True, TypeError, r"^fr\.scatter: dim must be an int, got True of type bool$"),
    ],
)
def test_scatter_dim(value: object, error: type[Exception], text: str) -> None:
    with pytest.raises(error, match=text):
        fr.scatter({"x": torch.ones(4)}, ["cpu", "cpu"], dim=value)  # type: ignore[arg-type]


def test_scatter_sparse_leaf() -> None:
    with pytest.raises(
        TypeError,
        match=r"^fr\.scatter: the tensor at \['x'\] has layout torch\.sparse_coo, which cannot "
        r"be packed into a flat buffer; convert it \(e\.g\. \.to_dense\(\)\)",
    ):
        fr.scatter({"x": torch.ones(4, 2).to_sparse()}, ["cpu", "cpu"])


def test_gather_a_single_tree() -> None:
    with pytest.raises(
        TypeError,
        match=r"^fr\.gather: trees must be a list of trees \(one per device\), got a dict; "
        r"wrap a single tree in a list: \[tree\]$",
    ):
        fr.gather({"y": torch.ones(2)}, "cpu")
    with pytest.raises(TypeError, match=r"^fr\.gather: dim must be an int, got '0'"):
        fr.gather([{"y": torch.ones(2)}], "cpu", dim="0")  # type: ignore[arg-type]


@pytest.mark.parametrize("trees", [{"w": torch.ones(1), "b": torch.ones(1)}, torch.ones(2)])
def test_all_reduce_a_single_tree(trees: object) -> None:
    with pytest.raises(TypeError, match=r"^fr\.all_reduce: trees must be a list of trees"):
        fr.all_reduce(trees)  # type: ignore[arg-type]


def test_all_reduce_of_a_state_is_refused() -> None:
    s = fr.state(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"^fr\.all_reduce: trees must be a list .* got a State"):
        fr.all_reduce(s)


def test_all_reduce_tensor_where_tree_0_has_none() -> None:
    t = torch.ones(2)
    with pytest.raises(
        ValueError,
        match=r"^fr\.all_reduce: trees differ at \['n'\]: an int \(3\) in tree 0, a tensor of "
        r"shape \(2,\) and dtype torch\.float32 in tree 1$",
    ):
        fr.all_reduce([{"w": t, "n": 3}, {"w": t, "n": t}])


def test_parallel_apply_takes_any_iterable() -> None:
    replicas = (torch.tensor(float(i)) for i in range(3))
    inputs = ((torch.tensor(2.0),) for _ in range(3))
    devices = iter(["cpu"] * 3)
    out = fr.parallel_apply(lambda w, x: w * x, replicas, inputs, devices=devices)
    assert [float(o) for o in out] == [0.0, 2.0, 4.0]
    kwargs = ({"k": k} for k in range(2))
    out = fr.parallel_apply(lambda w, k: w + k, iter([1, 2]), [(), ()], kwargs=kwargs)
    assert out == [1, 3]


def test_parallel_apply_bad_arguments() -> None:
    with pytest.raises(TypeError, match=r"^fr\.parallel_apply: fn must be callable, got int$"):
        fr.parallel_apply(3, [1], [()])  # type: ignore[arg-type]
    with pytest.raises(
        TypeError,
        match=r"^fr\.parallel_apply: replicas must be a list \(or any iterable\) with one entry "
        r"per replica, got int$",
    ):
        fr.parallel_apply(print, 3, [()])  # type: ignore[arg-type]


def test_data_parallel_checks_the_state() -> None:
    m = torch.nn.Linear(2, 2)
    with pytest.raises(
        TypeError,
        match=r"^fr\.data_parallel: state\.buffers must be a dict of name -> tensor, got NoneType",
    ):
        fr.data_parallel(
            m,
            fr.State(dict(m.named_parameters()), None),
            torch.ones(2, 2),  # type: ignore[arg-type]
            devices=["cpu"],
        )
    with pytest.raises(
        TypeError,
        match=r"^fr\.data_parallel: state\.params\['w'\] must be a tensor, got an int \(3\)$",
    ):
        fr.data_parallel(m, fr.State({"w": 3}, {}), torch.ones(2, 2), devices=["cpu"])  # type: ignore[dict-item]


def test_op_and_choice_wording() -> None:
    with pytest.raises(ValueError, match=r"^fr\.x: op must be 'sum' or 'mean', got 'max'$"):
        _checks.check_op("fr.x", "max")
    with pytest.raises(
        ValueError, match=r"^fr\.x: compress must be None, 'bf16' or 'fp16', got 3$"
    ):
        _checks.check_choice("fr.x", "compress", 3, (None, "bf16", "fp16"))
    _checks.check_choice("fr.x", "compress", None, (None, "bf16", "fp16"))


@pytest.mark.parametrize(
    "value, error, text",
    [
        (float("nan"), ValueError, r"must be a finite positive number, got nan$"),
        (float("inf"), ValueError, r"must be a finite positive number, got inf$"),
        (-1, ValueError, r"must be a finite positive number, got -1$"),
        (0, ValueError, r"must be a finite positive number, got 0$"),
        ("25", TypeError, r"must be a number, got '25' of type str$"),
        (True, TypeError, r"must be a number, got True of type bool$"),
    ],
)
def test_check_positive(value: object, error: type[Exception], text: str) -> None:
    with pytest.raises(error, match=r"^fr\.x: bucket_cap_mb " + text):
        _checks.check_positive("fr.x", "bucket_cap_mb", value)
    assert _checks.check_positive("fr.x", "bucket_cap_mb", 2) == 2.0
