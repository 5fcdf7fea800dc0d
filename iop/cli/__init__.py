"""
C{iop}: the operator's command line for an Edge (see L{iop.cli.main}).
"""
