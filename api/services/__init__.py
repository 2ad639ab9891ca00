"""Domain services: keyword-only functions taking ``session=``, raising ``api.errors``, never committing.

Routes and the dashboard both call these; the caller owns the transaction (``Database.write()``).
"""
