"""The device-map advisor: a cost model fitted from a profiled run (``profile``), the candidate maps of a
cluster as config overrides (``candidates``), their predicted step time (``predict``) and the ranked advice that
``hybridrl plan CONFIG --advise`` prints (``advise``). Pure logic: nothing here starts a process."""
