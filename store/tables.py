"""The SQLModel classes of store/schema.py as DuckDB SQL: each table's DDL, its columns, and the
columns a store made by an older version lacks, added when it is opened.

The classes are the one definition of the tables; everything here is derived from them. The
ORM takes a second to import: readers never import this module (a reader such as `report build`
knows a store matches this schema from its stamp, `store.db`), and writers read what it derives
from a cache (`store.schema_sql`); they import it only to bring an older store's tables up to date.
"""

from __future__ import annotations

from typing import Any

import duckdb
from duckdb_engine import Dialect
from sqlalchemy import Column, Table
from sqlalchemy.schema import CreateTable
from sqlmodel import SQLModel

from servescope.store import queries
from servescope.store.schema import TABLES, Event

_DIALECT = Dialect()


def table_of(model: type[SQLModel]) -> Table:
    # a table class's name is a str (SQLModel's type also allows the function computing it)
    return SQLModel.metadata.tables[str(model.__tablename__)]


def create_statements() -> list[str]:
    """CREATE TABLE IF NOT EXISTS for every table, in TABLES' order."""
    return [
        str(CreateTable(table_of(model), if_not_exists=True).compile(dialect=_DIALECT)).strip()
        for model in TABLES
    ]


def column_spec(column: Column[Any]) -> str:
    """The column's type as its DDL says it (with its storage options)."""
    return column.type.compile(dialect=_DIALECT)


def column_type(column: Column[Any]) -> str:
    """The column's type as DuckDB names it (`DOUBLE`, `VARCHAR`, `DOUBLE[]`…): what
    `duckdb_columns()` shows for it and what a cast to it says."""
    return str(duckdb.sqltype(column_spec(column).partition(" USING ")[0]))


def columns(model: type[SQLModel]) -> list[tuple[str, str]]:
    """The table's columns as (name, DuckDB type), in the class's order."""
    return [(column.name, column_type(column)) for column in table_of(model).columns]


def add_missing_columns(con: duckdb.DuckDBPyConnection, missing: list[tuple[str, str]]) -> None:
    """The (table, column) pairs newer than the store's tables (`schema_sql.missing_columns`):
    added (at the end: every insert names its columns), an `events` column filled from the
    rows' documents. Runs after the CREATE statements, so a missing table is already whole."""
    for table, name in missing:
        column = SQLModel.metadata.tables[table].columns[name]
        con.execute(f'ALTER TABLE {table} ADD COLUMN "{name}" {column_spec(column)}')
        if table == table_of(Event).name:
            fill = queries.event_column_from_doc(name, column_type(column))
            con.execute(f'UPDATE {table} SET "{name}" = {fill}')  # noqa: S608 - from the schema
