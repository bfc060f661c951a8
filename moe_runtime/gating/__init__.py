"""gating"""
