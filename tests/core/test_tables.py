"""The one CSV and the one markdown writer: names with commas, quotes or pipes survive, ordinary tables are plain."""

import csv
import io

from bhfl_core.analysis.communication import CommRow, rows_csv
from bhfl_core.analysis.evaluation import EvalRow, matrix_csv
from bhfl_core.store.tables import table_csv, table_markdown


def test_a_value_with_a_comma_and_a_quote_round_trips():
    odd = 'edge,"north" 1'
    text = table_csv(["node", "value", "empty"], [[odd, 0.5, None], ["plain", 2, ""]])
    assert list(csv.reader(io.StringIO(text))) == [["node", "value", "empty"], [odd, "0.5", ""], ["plain", "2", ""]]
    assert text.endswith("\n") and "\r" not in text


def test_a_node_name_with_a_comma_stays_one_field_in_the_matrix():
    text = matrix_csv([EvalRow("edge,1", 1, 'test "a"', "accuracy", 0.25)])
    assert list(csv.DictReader(io.StringIO(text))) == [
        {"node": "edge,1", "level": "1", "test_set": 'test "a"', "metric": "accuracy", "value": "0.250000"}
    ]


def test_ordinary_output_is_unchanged():
    assert matrix_csv([]) == "node,level,test_set,metric,value\n"
    assert matrix_csv([EvalRow("root", 0, "union", "accuracy", 0.8125), EvalRow("e1", 1, "c3", "macro_f1", 1 / 3)]) == (
        "node,level,test_set,metric,value\nroot,0,union,accuracy,0.812500\ne1,1,c3,macro_f1,0.333333\n"
    )
    rows = [
        CommRow(0, "root", 1, "down", "regular", 3.0, 3.0 * 10 * 4),
        CommRow(1, "e1", 2, "up", "residual", 0.5, 20.0),
    ]
    assert rows_csv(rows) == (
        "level,node,round,direction,kind,models,bytes\n0,root,1,down,regular,3,120\n1,e1,2,up,residual,0.5,20\n"
    )


def test_a_markdown_cell_never_splits_its_row():
    text = table_markdown(["node", "value"], [["edge|1", None], ["two\nlines", 0.5]])
    assert text == "| node | value |\n|---|---|\n| edge\\|1 |  |\n| two lines | 0.5 |"
    assert table_markdown(["a", "b"], []) == "| a | b |\n|---|---|"  # no rows: the header alone, no line end
