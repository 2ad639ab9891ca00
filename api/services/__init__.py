"""Domain services: keyword-only functions taking ``session=``, raising domain errors.

They never commit.

Routes and the dashboard both call these; the caller owns the transaction (``Database.write()``).
"""
