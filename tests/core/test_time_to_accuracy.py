"""Time to accuracy: the evaluation curve against virtual time and the first time a target is met."""

from bhfl_core.analysis.time_to_accuracy import CurvePoint, curve, curve_csv, round_label, time_to_target


def test_curve_joins_by_step_and_finds_the_first_time_at_target():
    virtual = {1: 10.0, 2: 25.0, 3: 31.0, 4: 50.0}
    accuracy = {2: 0.40, 4: 0.62, 3: 0.55, 5: 0.9}  # step 5 has no virtual time: left out
    points = curve(virtual, accuracy)
    assert points == [CurvePoint(2, 25.0, 0.40), CurvePoint(3, 31.0, 0.55), CurvePoint(4, 50.0, 0.62)]
    assert time_to_target(points, 0.5) == 31.0
    assert time_to_target(points, 0.4) == 25.0  # reaching the target exactly counts
    assert time_to_target(points, 0.7) is None
    loss = curve(virtual, {1: 2.0, 2: 1.2, 3: 0.9})
    assert time_to_target(loss, 1.0, higher_is_better=False) == 31.0  # lower is better: at or below
    assert curve_csv(points[:1], "accuracy").splitlines() == ["step,virtual_s,accuracy", "2,25.000000,0.400000"]


def test_a_step_past_the_last_root_round_is_named_as_a_re_evaluation():
    # bhfl resume --force-eval logs its n-th evaluation of a 3-round run at step 3 + n
    assert [round_label(step, 3) for step in (1, 3)] == ["1", "3"]
    assert round_label(4, 3) == "3, re-evaluation 1 (MLflow step 4)"
    assert round_label(6, 3) == "3, re-evaluation 3 (MLflow step 6)"
