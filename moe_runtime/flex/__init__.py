"""flex"""
