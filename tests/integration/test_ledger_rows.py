"""The ledger's row types are its tables' own: each field is a column of the table it is read
from, so a statement selecting `column_list(Row)` reads exactly the table's columns, and a
column added by a migration without its field (or a field renamed) fails here."""

import dataclasses

import psycopg
import pytest

from retex.ledger import Ledger
from retex.ledger.records import AttemptRecord, HistoryEntry, Refusal
from retex.ledger.rows import RunLimits, StepRow, TaskRow


def table_columns(dsn: str, table: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        return [name for (name,) in conn.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_schema = 'retex' AND table_name = %s",
            (table,))]


@pytest.mark.parametrize(("row", "table"), [(TaskRow, "tasks"), (StepRow, "steps")])
def test_a_tables_row_type_has_a_field_for_each_of_its_columns_and_no_other(ledger: Ledger, dsn, row, table):
    assert sorted(f.name for f in dataclasses.fields(row)) == sorted(table_columns(dsn, table))


@pytest.mark.parametrize(("row", "table"), [(RunLimits, "run_limits"), (AttemptRecord, "attempts"),
                                            (HistoryEntry, "history"), (Refusal, "refusals")])
def test_a_records_fields_are_columns_of_the_table_it_is_read_from(ledger: Ledger, dsn, row, table):
    assert {f.name for f in dataclasses.fields(row)} <= set(table_columns(dsn, table))
