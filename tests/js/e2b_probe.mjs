// E2B's JS SDK against `sandfleet e2b` (tests/test_e2b.py runs it with E2B_API_URL, E2B_SANDBOX_URL
// and E2B_API_KEY set): every step prints one JSON line the test checks.
import { Sandbox, CommandExitError } from 'e2b'

const say = (step, value) => console.log(JSON.stringify({ step, value }))
const sbx = await Sandbox.create('base', { timeoutMs: 120000 })
say('created', sbx.sandboxId)
try {
  const r = await sbx.commands.run('echo hello from js; whoami; pwd')
  say('run', [r.stdout, r.exitCode])
  await sbx.files.write('js.txt', 'written by js')
  say('read', await sbx.files.read('js.txt'))
  say('list', (await sbx.files.list('.')).map((e) => e.name).sort())
  const h = await sbx.commands.run('sleep 300', { background: true })
  say('killed', await sbx.commands.kill(h.pid))
  try {
    await sbx.commands.run('exit 3')
    say('exit', null)
  } catch (e) {
    say('exit', [e instanceof CommandExitError, e.exitCode])
  }
  const info = await sbx.getInfo()
  say('info', [info.templateId, info.state])
} finally {
  say('kill', await sbx.kill())
}
