"""Thin HTTP routes: parse, open the transaction, call a service, return a schema."""
