"""ragen_core"""
